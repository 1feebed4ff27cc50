"""Bad inputs to `xlaserve convert`: one clear line naming the file, and nothing half-written."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import finish_gguf
from xlaserve.checkpoints.convert import convert_gguf, convert_hf
from xlaserve.checkpoints.errors import CheckpointError
from xlaserve.checkpoints.gguf_file import read_gguf
from xlaserve.checkpoints.store import atomic_folder
from xlaserve.models.config import ModelConfig


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "xlaserve.cli", *args], capture_output=True,
                          text=True, timeout=300)


def _no_leftovers(out: Path) -> None:
    assert not out.exists()
    assert not [p for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.tmp")]


def test_missing_path(tmp_path: Path) -> None:
    r = _cli("convert", "gguf", str(tmp_path / "nope.gguf"), str(tmp_path / "out"))
    assert r.returncode == 2
    assert r.stderr.strip().count("\n") == 0, r.stderr
    assert "nope.gguf: no such file" in r.stderr
    _no_leftovers(tmp_path / "out")


def test_corrupt_gguf(tmp_path: Path) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"this is not a gguf file at all" * 100)
    r = _cli("convert", "gguf", str(bad), str(tmp_path / "out"))
    assert r.returncode == 2 and "bad.gguf" in r.stderr and "not a readable GGUF" in r.stderr
    assert r.stderr.strip().count("\n") == 0, r.stderr
    _no_leftovers(tmp_path / "out")


def test_truncated_gguf(tmp_path: Path, gguf_file: Path) -> None:
    cut = tmp_path / "cut.gguf"
    with open(gguf_file, "rb") as src, open(cut, "wb") as dst:
        dst.write(src.read(gguf_file.stat().st_size // 2))
    with pytest.raises(CheckpointError, match=r"cut\.gguf.*truncated|cut\.gguf.*not a readable"):
        convert_gguf(cut, tmp_path / "out", quiet=True)
    _no_leftovers(tmp_path / "out")
    r = _cli("convert", "gguf", str(cut), str(tmp_path / "out"))
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0, r.stderr


def test_unsupported_architecture(tmp_path: Path) -> None:
    import gguf
    import numpy as np

    path = tmp_path / "gpt2.gguf"
    w = gguf.GGUFWriter(str(path), "gpt2")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((8, 4), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(CheckpointError, match=r"gpt2\.gguf: unsupported architecture 'gpt2'"):
        convert_gguf(path, tmp_path / "out", quiet=True)
    _no_leftovers(tmp_path / "out")


def test_failure_midway_leaves_nothing(tmp_path: Path, model_dir: Path) -> None:
    """An HF folder whose safetensors lack a layer fails after writing has begun."""
    src = tmp_path / "hf"
    src.mkdir()
    (src / "config.json").write_text(
        '{"model_type": "llama", "vocab_size": 16, "hidden_size": 8, "intermediate_size": 16,'
        ' "num_hidden_layers": 2, "num_attention_heads": 2}')
    import numpy as np
    from safetensors.numpy import save_file

    save_file({"model.embed_tokens.weight": np.zeros((16, 8), np.float32),
               "model.norm.weight": np.ones(8, np.float32)}, str(src / "model.safetensors"))
    shutil.copy(model_dir / "tokenizer.json", src / "tokenizer.json")
    with pytest.raises(CheckpointError, match="model.layers.0.*missing"):
        convert_hf(src, tmp_path / "out", quiet=True)
    _no_leftovers(tmp_path / "out")


def test_refuses_to_overwrite(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(CheckpointError, match="already exists"):
        convert_hf(tmp_path, out, quiet=True)


def _old_model(tmp_path: Path) -> Path:
    out = tmp_path / "model"
    out.mkdir()
    (out / "config.json").write_text("OLD")
    return out


def _no_swap_leftovers(out: Path) -> None:
    assert sorted(p.name for p in out.parent.iterdir()) == [out.name]


def test_overwrite_swaps_in_the_new_folder(tmp_path: Path) -> None:
    out = _old_model(tmp_path)
    with atomic_folder(out, overwrite=True) as tmp:
        (tmp / "config.json").write_text("NEW")
    assert (out / "config.json").read_text() == "NEW"
    _no_swap_leftovers(out)


def test_failed_swap_keeps_the_old_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A rename that fails (or a Ctrl-C) while the new folder is moved into place: the old
    model must come back intact and no temporary folder stay behind.  The failure is injected
    at os.replace because a real rename failure cannot be produced portably."""
    import os

    from xlaserve.checkpoints import store

    real_replace = os.replace

    def replace(a, b):
        if Path(a).name.startswith(".model.tmp-"):
            raise KeyboardInterrupt("simulated Ctrl-C during the swap")
        real_replace(a, b)

    out = _old_model(tmp_path)
    monkeypatch.setattr(store.os, "replace", replace)
    with pytest.raises(KeyboardInterrupt), atomic_folder(out, overwrite=True) as tmp:
        (tmp / "config.json").write_text("NEW")
    assert (out / "config.json").read_text() == "OLD"
    _no_swap_leftovers(out)


@pytest.mark.parametrize("out", [".", "./", "..", ""])
def test_refuses_the_working_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                       gguf_file: Path, out: str) -> None:
    work = tmp_path / "work"
    work.mkdir()
    src = work / "model.gguf"
    shutil.copy(gguf_file, src)
    monkeypatch.chdir(work)
    with pytest.raises(CheckpointError, match="current directory|empty"):
        convert_gguf(src, out, overwrite=True, quiet=True)
    assert sorted(p.name for p in work.iterdir()) == ["model.gguf"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["work"]


def test_refuses_an_output_holding_the_source(tmp_path: Path, gguf_file: Path) -> None:
    src = tmp_path / "models" / "model.gguf"
    src.parent.mkdir()
    shutil.copy(gguf_file, src)
    with pytest.raises(CheckpointError, match=r"models: output folder would replace the source"):
        convert_gguf(src, tmp_path / "models", overwrite=True, quiet=True)
    assert src.exists()


def _tiny_gguf(path: Path, scaling_type: str | None = None,
               extra: dict[str, object] | None = None) -> Path:
    """Metadata and an embedding only: enough for read_gguf to build a config (head_dim 8)."""
    import gguf
    import numpy as np

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(64)
    w.add_embedding_length(16)
    w.add_feed_forward_length(32)
    w.add_block_count(1)
    w.add_head_count(2)
    w.add_head_count_kv(1)
    if scaling_type is not None:
        w.add_rope_scaling_type(gguf.RopeScalingType(scaling_type))
        w.add_rope_scaling_factor(4.0)
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"t{i}" for i in range(8)])
    w.add_tensor("token_embd.weight", np.zeros((8, 16), np.float32))
    finish_gguf(w, extra)
    return path


@pytest.mark.parametrize("scaling_type", ["yarn", "longrope"])
def test_gguf_unsupported_rope_scaling(tmp_path: Path, scaling_type: str) -> None:
    path = _tiny_gguf(tmp_path / "scaled.gguf", scaling_type)
    with pytest.raises(CheckpointError, match=rf"scaled\.gguf: unsupported rope scaling type "
                                              rf"'{scaling_type}' in llama\.rope\.scaling\.type"):
        read_gguf(path)
    _no_leftovers(tmp_path / "out")


def test_gguf_rope_freqs_are_validated(tmp_path: Path) -> None:
    import numpy as np

    short = _tiny_gguf(tmp_path / "short.gguf",
                       extra={"rope_freqs.weight": np.ones(3, np.float32)})
    with pytest.raises(CheckpointError, match=r"short\.gguf: .*rope_freq_factors has 3 values, "
                                              r"expected head_dim // 2 = 4"):
        read_gguf(short)
    zero = _tiny_gguf(tmp_path / "zero.gguf",
                      extra={"rope_freqs.weight": np.array([1, 1, 0, 8], np.float32)})
    with pytest.raises(CheckpointError, match=r"zero\.gguf: .*positive finite floats, got \[0\.0\]"):
        read_gguf(zero)
    good = _tiny_gguf(tmp_path / "good.gguf",
                      extra={"rope_freqs.weight": np.array([1, 1, 2, 8], np.float32)})
    config = read_gguf(good).config
    assert config.rope_freq_factors == (1.0, 1.0, 2.0, 8.0)
    config.save(tmp_path / "config.json")
    assert ModelConfig.load(tmp_path / "config.json") == config


def test_gguf_unused_tensors_are_reported(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    import numpy as np

    path = _tiny_gguf(tmp_path / "extra.gguf", extra={
        "rope_freqs.weight": np.ones(4, np.float32),
        "mystery.weight": np.zeros(4, np.float32),
        "blk.0.attn_q_norm.weight": np.zeros(4, np.float32)})
    with caplog.at_level("WARNING", logger="xlaserve.checkpoints.gguf_file"):
        model = read_gguf(path)
    assert "model.embed_tokens.weight" in model.tensors
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1, warnings
    assert "extra.gguf: ignoring 2 tensor(s)" in warnings[0]
    assert "mystery.weight" in warnings[0] and "blk.0.attn_q_norm.weight" in warnings[0]
    assert "rope_freqs" not in warnings[0]
