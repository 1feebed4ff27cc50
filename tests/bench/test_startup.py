"""`xlaserve bench startup` on the tiny model: load and compile measured for the model and a
one-layer variant, each compile a real backend compile (the persistent cache is off)."""

from __future__ import annotations

import json

import jax

from xlaserve.cli import main


def test_startup_rows(tiny_llama, tmp_path, capsys) -> None:
    _, ours = tiny_llama
    cache_before = jax.config.jax_enable_compilation_cache
    out = tmp_path / "startup.json"
    rc = main(["bench", "startup", "--model", str(ours), "--variant-layers", "1",
               "--chunk", "32", "--width", "4", "--json", str(out)])
    assert rc == 0
    assert jax.config.jax_enable_compilation_cache == cache_before
    stdout = capsys.readouterr().out
    assert "decode compile s" in stdout and "1-layer variant" in stdout
    rows = json.loads(out.read_text())["rows"]
    assert [r["layers"] for r in rows] == [2, 1]
    for r in rows:
        assert r["load_s"] > 0 and r["decode_compile_s"] > 0 and r["prefill_compile_s"] > 0
        assert r["decode_bucket"] == [1, 1, 4] and r["prefill_bucket"] == [1, 32, 4]
    assert rows[0]["param_mib"] > rows[1]["param_mib"]
