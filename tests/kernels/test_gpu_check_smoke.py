"""The H200 check script runs unattended: its --cpu-smoke path end to end, through the shell
wrapper, in a fresh process (tiny shapes, kernels in interpret mode)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

WRAPPER = Path(__file__).resolve().parents[2] / "xlaserve/kernels/bench/gpu_check.sh"


def test_gpu_check_cpu_smoke(tmp_path):
    out = tmp_path / "check.json"
    env = dict(os.environ, PYTHON=sys.executable, JAX_PLATFORMS="cpu")
    proc = subprocess.run([str(WRAPPER), "--cpu-smoke", "--json", str(out)], env=env,
                          capture_output=True, text=True, timeout=170)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["triton_skipped"] == "jax-triton needs a GPU"
    assert report["interpret"] is True
    ops = {(r["op"], r["dtype"]) for r in report["correctness"]}
    assert {("pallas", "float32"), ("pallas", "bfloat16"), ("jax_pallas_gpu", "float32")} <= ops
    for section in ("correctness", "kernels", "model", "fp8"):
        assert report[section] and all(r["status"] == "ok" for r in report[section]), section
    assert {r["backend"] for r in report["model"]} == {"reference", "pallas"}
    # fp8 weights and KV (a GPU option, the jnp path here): checked, timed and served
    assert {r["check"] for r in report["fp8"]} == {"fp8 weight matmul", "fp8 KV pallas decode",
                                                   "weight matmul time"}
    assert {r["format"] for r in report["fp8"] if "format" in r} == {"bfloat16", "int8", "fp8"}
    assert "fp8 weights, float8_e4m3fn KV" in {r["variant"] for r in report["model"]}
    assert all(r["bytes_per_s"] > 0 for r in report["kernels"])
    # The table comes last.
    tail = proc.stdout.strip().splitlines()
    assert tail[-1].startswith("tiny 2-layer") and "tok/s" in tail[-len(report["model"]) - 1]
