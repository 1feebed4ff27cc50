"""`xlaserve bench step` on tiny weights: every decode and prefill bucket timed once warm,
next to a floor made of the same run's probes, decode steps also timed pipelined, and the
breakdown's parts named; the CLI writes the same report as JSON."""

from __future__ import annotations

import json

import pytest

from xlaserve.bench.roofline import decode_read_bytes
from xlaserve.bench.step import format_report, run_steps
from xlaserve.cli import main
from xlaserve.serving.loading import load_model
from xlaserve.serving.runner.buckets import BucketPlan
from xlaserve.serving.runner.runner import ModelRunner


def test_steps_sit_above_their_floors(tiny_llama) -> None:
    _, ours = tiny_llama
    model = load_model(str(ours))
    runner = ModelRunner(model.params, model.config, model.mesh, num_blocks=2 * 4 + 2,
                         block_size=16, max_num_seqs=2,
                         buckets=BucketPlan(row_sizes=(1, 2), token_sizes=(1, 2, 16),
                                            table_widths=(4,)))
    report = run_steps(runner, decode_batches=[1, 2], width=4, context=20, prefill_chunks=[16],
                       repeats=2, breakdown=True, probe_bytes=16 << 20)
    assert report.read_gb_s == max(v for k, v in report.probes.items()
                                   if k.startswith("read_"))
    assert report.gemm_gflops == max(v for k, v in report.probes.items()
                                     if k.startswith("gemm_"))
    assert [(r.kind, r.rows, r.tokens) for r in report.rows] == \
        [("decode", 1, 1), ("decode", 2, 2), ("prefill", 1, 16)]
    for r in report.rows:   # each floor from the probes run around that step
        assert r.read_gb_s > 0 and r.gemm_gflops > 0
        mem_ms = 1e3 * r.bytes_read / (r.read_gb_s * 1e9)
        flop_ms = 1e3 * r.flops / (r.gemm_gflops * 1e9)
        assert r.floor_ms == pytest.approx(max(mem_ms, flop_ms))
        assert r.bound == ("memory" if mem_ms >= flop_ms else "compute")
        assert r.bytes_read > decode_read_bytes(runner.params)   # weights, then the K/V too
        assert r.ms > 0 and r.ratio == pytest.approx(r.ms / r.floor_ms)
        assert set(r.breakdown) == {"weights", "attention", "head", "sampler", "host"}
        assert (r.pipelined_ms is not None) == (r.kind == "decode")
    assert report.rows[0].bucket[:2] == (1, 1) and report.rows[2].bucket[1] >= 16
    table = format_report(report)
    assert "| decode 2 x ctx 20 |" in table and "pipelined ratio" in table


def test_cli_writes_the_report(tiny_llama, tmp_path, capsys) -> None:
    _, ours = tiny_llama
    out = tmp_path / "step.json"
    assert main(["bench", "step", "--model", str(ours), "--rows", "1", "--width", "4",
                 "--context", "10", "--chunks", "16", "--repeats", "2",
                 "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert [r["kind"] for r in data["rows"]] == ["decode", "prefill"]
    assert data["rows"][0]["pipelined_ratio"] > 0 and data["rows"][1]["pipelined_ms"] is None
    assert "decode 1 rows x ctx 10" in capsys.readouterr().out
