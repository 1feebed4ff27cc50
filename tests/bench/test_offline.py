"""`xlaserve bench offline` on the tiny workload: all three systems on the same tiny weights,
one table, a JSON report, every request's exact token count, identical greedy tokens from
static batching and the engine, and no compilation after warm-up."""

from __future__ import annotations

import json

import pytest

from xlaserve.bench.metrics import KVWasteMeter
from xlaserve.bench.offline import OfflineOptions
from xlaserve.bench.workload import get_workload
from xlaserve.cli import main
from xlaserve.serving.tokenizer import Tokenizer


def test_offline_tiny_all_systems(tiny_llama, tmp_path, capsys) -> None:
    hf_dir, ours = tiny_llama
    out = tmp_path / "report.json"
    rc = main(["bench", "offline", "--model", str(ours), "--workload", "tiny",
               "--systems", "engine,static,hf", "--hf-dir", str(hf_dir), "--batch", "2",
               "--json", str(out), "--copy-mib", "16", "--decode-steps", "5"])
    assert rc == 0
    stdout = capsys.readouterr().out
    lines = stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("| system"))
    for title in ("out tok/s", "req/s", "lat mean s", "lat p99 s", "KV waste", "compiles"):
        assert title in lines[header]
    rows = [line.split("|")[1].strip() for line in lines[header + 2:header + 5]]
    assert rows == ["engine", "static(B=2)", "hf(B=2)"]
    assert "decode step at batch 1" in stdout and "bandwidth floor" in stdout
    assert "per device: params" in stdout
    assert "engine host time per step (ms; wait = blocked on the device): schedule" in stdout

    report = json.loads(out.read_text())
    workload = get_workload("tiny").build(Tokenizer.load(ours), seed=0)
    expected = {r.request_id: r.num_output_tokens for r in workload.requests}
    assert report["workload"]["num_requests"] == len(expected) == 4
    assert report["workload"]["output_tokens"] == sum(expected.values())
    assert [s["system"] for s in report["systems"]] == ["engine", "static(B=2)", "hf(B=2)"]
    for s in report["systems"]:
        assert s["requests"] == 4 and s["output_tokens"] == sum(expected.values())
        assert s["output_tokens_per_s"] > 0 and s["requests_per_s"] > 0
        assert 0 < s["latency_mean_s"] <= s["latency_p99_s"] <= s["wall_s"]
        assert 0 <= s["kv_waste"] < 1 and s["kv_peak_slots"] > 0
        per_request = report["requests"][s["system"]]
        assert {rid: r["num_tokens"] for rid, r in per_request.items()} == expected
        assert all(len(r["token_ids"]) == r["num_tokens"] for r in per_request.values())
    engine, static, hf = report["systems"]
    host = engine["host_ms_per_step"]
    assert set(host) == {"schedule", "launch", "process", "wait", "masks"}
    assert host["launch"] > 0 and host["masks"] == 0   # no request under a constraint
    assert engine["compiles_after_warmup"] == 0 and static["compiles_after_warmup"] == 0
    assert hf["compiles_after_warmup"] is None
    # Static rows wait for their batch's longest request; the engine frees them at once.
    assert static["kv_waste"] > engine["kv_waste"]

    tokens = {name: {rid: r["token_ids"] for rid, r in reqs.items()}
              for name, reqs in report["requests"].items()}
    assert tokens["static(B=2)"] == tokens["engine"]
    assert report["agreement"]["static(B=2) == engine"] == 4

    d = report["decode_batch1"]
    assert d["step_ms"] > 0 and d["bandwidth_gb_s"] > 0 and d["param_bytes"] > 0
    assert d["ratio"] == pytest.approx(d["step_ms"] / d["floor_ms"])
    assert d["bandwidth_gb_s"] == max(d["probes_gb_s"].values())
    assert report["memory"]["params"] == d["param_bytes"]
    assert report["memory"]["kv"] > 0


def test_options_are_checked(tiny_llama, capsys) -> None:
    with pytest.raises(ValueError, match="choose from"):
        OfflineOptions(systems=("engine", "vllm"))
    with pytest.raises(ValueError, match="--gguf FILE or --hf-dir DIR"):
        OfflineOptions(systems=("hf",))
    with pytest.raises(ValueError, match="unknown workload"):
        OfflineOptions(workload="nope", systems=("engine",))
    _, ours = tiny_llama
    rc = main(["bench", "offline", "--model", str(ours), "--systems", "hf"])
    assert rc == 2
    err = capsys.readouterr().err
    assert "--gguf FILE or --hf-dir DIR" in err and err.strip().count("\n") == 0


def test_kv_waste_meter_is_time_weighted() -> None:
    m = KVWasteMeter()
    m.sample(0.0, 100, 50)      # holds for 1 s
    m.sample(1.0, 200, 0)       # holds for 2 s
    m.finish(3.0)
    assert m.waste == pytest.approx(50 / (100 + 400))
    assert m.peak_allocated == 200


def test_breakdown_accounts_for_every_token(tiny_llama, tmp_path, capsys) -> None:
    """--breakdown reruns engine and static with each call timed per bucket; the real tokens
    it counts are exactly the prompts' and the decode steps' (no call missed or counted twice)."""
    _, ours = tiny_llama
    out = tmp_path / "report.json"
    rc = main(["bench", "offline", "--model", str(ours), "--workload", "tiny",
               "--systems", "engine,static", "--batch", "2", "--breakdown",
               "--json", str(out), "--copy-mib", "16", "--decode-steps", "3"])
    assert rc == 0
    stdout = capsys.readouterr().out
    assert "breakdown of engine" in stdout and "breakdown of static" in stdout
    report = json.loads(out.read_text())
    workload = get_workload("tiny").build(Tokenizer.load(ours), seed=0)
    prompts = sum(len(r.prompt_token_ids) for r in workload.requests)
    outputs = [r.num_output_tokens for r in workload.requests]

    def tokens(system: str) -> int:
        return sum(b["real_tokens"] for b in report["breakdown"][system]["buckets"])

    # A step runs its decodes and prefill chunks in one call: every token fed is counted once,
    # prompts (less prefix hits) and each generated token but the last.
    engine = next(s for s in report["systems"] if s["system"] == "engine")
    assert tokens("engine") == prompts - engine["prefix_hit_tokens"] + sum(outputs) - len(outputs)
    batches = [outputs[i:i + 2] for i in range(0, len(outputs), 2)]
    assert tokens("static") == prompts + sum(len(b) * (max(b) - 1) for b in batches)
    for b in report["breakdown"].values():
        assert b["seconds"] == pytest.approx(sum(p for p in b["phases"].values()))
        assert all(r["real_tokens"] <= r["padded_tokens"] and r["calls"] > 0
                   and r["ms_per_call"] > 0 for r in b["buckets"])
