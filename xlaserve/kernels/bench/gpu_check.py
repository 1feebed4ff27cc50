"""H200 check of the attention kernels: correctness, kernel timings, full-model decode tokens/s.

    python -m xlaserve.kernels.bench.gpu_check [--wheels DIR] [--json PATH] [--budget-s 450]
    python -m xlaserve.kernels.bench.gpu_check --cpu-smoke      # tiny shapes, interpret mode

Steps, in order, each bounded by one overall time budget (entries past it are reported as
skipped, so the run ends in time and still prints its table):

  1. setup        install jax-triton==0.3.1 from a local wheel folder when it is missing
                  (--wheels or $XLASERVE_WHEELS; no network), measure device copy bandwidth
  2. correctness  every kernel against the pure-jnp reference on random bf16 and f32 inputs
  3. kernels      median time (warm-up, block_until_ready, many repeats) of each decode kernel,
                  the jnp reference and JAX's own pallas.ops.gpu.paged_attention, and of the
                  prefill kernel against the reference; achieved bytes/s vs copy bandwidth
  4. model        models.llama.forward decode tokens/s with SmolLM2-135M shapes (random
                  weights) at batch 1, 32, 256, per attention backend; then bf16 weights
                  against int8 and fp8 (e4m3) weights, and an fp8 KV cache, on Pallas
  5. fp8          fp8 weights (kernels/quantized.py, the jnp path) and fp8 KV rows
                  (kernels/kv_quant.py) against float references: the matmul within e4m3's
                  error of the float32 one and equal to the dequantized weight's, decode
                  attention over fp8 rows equal to the reference over the dequantized
                  cache; and the weight matmul's time in bf16 / int8 / fp8 (bytes it reads)

The summary table is printed last; everything also goes to the JSON file.  The steps live
beside this file: timing.py (budget, rows, medians), attention_checks.py (2, 3),
model_decode.py (4), fp8_checks.py (5), plans.py (the shapes of the GPU and smoke runs).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import subprocess
import sys
import time
from typing import Any

from xlaserve.kernels.bench.attention_checks import check_correctness, time_kernels
from xlaserve.kernels.bench.fp8_checks import check_fp8
from xlaserve.kernels.bench.model_decode import model_decode
from xlaserve.kernels.bench.plans import gpu_plan, smoke_plan
from xlaserve.kernels.bench.timing import Clock, copy_bandwidth

JAX_TRITON_VERSION = "0.3.1"


# -- setup -------------------------------------------------------------------------------------

def ensure_jax_triton(wheels: str | None) -> str:
    """Import status of jax-triton after installing it from `wheels` if needed (no network)."""
    if importlib.util.find_spec("jax_triton") is not None:
        return "installed"
    if not wheels:
        return "missing (pass --wheels DIR or set XLASERVE_WHEELS to install it)"
    cmd = [sys.executable, "-m", "pip", "install", "--no-index", "--no-deps", "--find-links",
           wheels, f"jax-triton=={JAX_TRITON_VERSION}"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    importlib.invalidate_caches()
    if proc.returncode != 0 or importlib.util.find_spec("jax_triton") is None:
        return f"install from {wheels} failed: {proc.stderr.strip()[-300:]}"
    return f"installed from {wheels}"


# -- report --------------------------------------------------------------------------------------

def table(report: dict[str, Any]) -> str:
    lines = [f"device: {report['device']}   copy bandwidth: "
             f"{report['copy_bandwidth_bytes_per_s'] / 1e9:.1f} GB/s   jax {report['jax']}   "
             f"jax-triton: {report['jax_triton']}"]
    checks = report["correctness"]
    bad = [r for r in checks if r["status"] != "ok"]
    lines.append(f"correctness: {len(checks) - len(bad)}/{len(checks)} ok"
                 + "".join(f"\n  {r['op']} {r['dtype']} {r['shape']}: {r['status']} "
                           f"(rel err {r.get('rel_error', float('nan')):.2e})" for r in bad))
    lines.append(f"{'kernel shape (bf16)':<58} {'op':<15} {'ms':>9} {'GB/s':>8} {'% copy':>7}")
    for r in report["kernels"]:
        if r["status"] == "ok":
            lines.append(f"{r['shape']:<58} {r['op']:<15} {r['ms']:>9.3f} "
                         f"{r['bytes_per_s'] / 1e9:>8.1f} {100 * r['frac_copy_bw']:>6.1f}%")
        else:
            lines.append(f"{r['shape']:<58} {r.get('op', ''):<15} {r['status']}")
    for r in report["fp8"]:
        what = f"{r['check']} {r.get('format', '')} {r['shape']}"
        if r["status"] != "ok":
            lines.append(f"{what}: {r['status']}")
        elif "ms" in r:
            lines.append(f"{what}: {r['ms']:.3f} ms, weights {r['bytes_per_s'] / 1e9:.1f} GB/s")
        else:
            lines.append(f"{what}: ok (rel err {r['rel_error']:.2e})")
    lines.append(f"{'model decode':<30} {'batch':>6} {'backend':<10} {'ms/step':>9} "
                 f"{'tok/s':>10}  weights, KV")
    for r in report["model"]:
        if r["status"] == "ok":
            lines.append(f"{r['model']:<30} {r['batch']:>6} {r['backend']:<10} "
                         f"{r['ms_per_step']:>9.3f} {r['tokens_per_s']:>10.1f}  {r['variant']}")
        else:
            lines.append(f"{r['model']:<30} {r['batch']:>6} {r['backend']:<10} {r['status']}"
                         f"  {r['variant']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cpu-smoke", action="store_true",
                   help="tiny shapes, kernels in interpret mode: proves the script runs")
    p.add_argument("--wheels", default=os.environ.get("XLASERVE_WHEELS"),
                   help="folder holding the jax-triton wheel (default $XLASERVE_WHEELS)")
    p.add_argument("--json", default="gpu_check.json", help="where to write the results")
    p.add_argument("--budget-s", type=float, default=450.0,
                   help="stop starting new measurements after this many seconds")
    args = p.parse_args(argv)
    start = time.perf_counter()
    clock = Clock(start + args.budget_s)

    jax_triton = "not used (--cpu-smoke)" if args.cpu_smoke else ensure_jax_triton(args.wheels)
    import jax

    on_gpu = jax.default_backend() == "gpu"
    if not args.cpu_smoke and not on_gpu:
        print(f"gpu_check needs a GPU; jax's backend is {jax.default_backend()!r} "
              f"(use --cpu-smoke on CPU)", file=sys.stderr)
        return 2
    interpret = not on_gpu
    if args.cpu_smoke:   # fp8 is a GPU option: the smoke run takes the test-only jnp path
        from xlaserve.kernels.quantized import FP8_ON_CPU_ENV

        os.environ[FP8_ON_CPU_ENV] = "1"
    triton_ok = on_gpu and importlib.util.find_spec("jax_triton") is not None
    plan = smoke_plan() if args.cpu_smoke else gpu_plan()

    bandwidth = copy_bandwidth(plan["bandwidth_bytes"], plan["repeats"])
    print(f"[setup] jax-triton: {jax_triton}; copy bandwidth {bandwidth / 1e9:.1f} GB/s",
          flush=True)
    report: dict[str, Any] = dict(
        device=str(jax.devices()[0].device_kind), platform=jax.default_backend(),
        jax=jax.__version__, python=platform.python_version(), jax_triton=jax_triton,
        interpret=interpret, copy_bandwidth_bytes_per_s=bandwidth,
        triton_skipped=None if triton_ok else "jax-triton needs a GPU" if not on_gpu
        else f"jax-triton unavailable: {jax_triton}")
    report["correctness"] = check_correctness(plan["check"], interpret, triton_ok, clock)
    report["kernels"] = time_kernels(plan["timed"], interpret, triton_ok, bandwidth,
                                     plan["repeats"], clock, plan["reference_limit"])
    backends = ["reference", "pallas"] + (["triton"] if triton_ok else [])
    report["model"] = model_decode(plan["label"], plan["batches"], plan["context"], backends,
                                   plan["model"],
                                   max(3, plan["repeats"] // 3), clock)
    # bf16 weights against int8 and fp8 ones, and an fp8 KV cache: Pallas decode
    for quantization, kv_dtype in plan["quantized_variants"]:
        report["model"] += model_decode(plan["label"], plan["quantized_batches"],
                                        plan["context"], ["pallas"],
                                        plan["quantized_model"].replace(
                                            quantization=quantization),
                                        max(3, plan["repeats"] // 3), clock, kv_dtype)
    report["fp8"] = check_fp8(plan, interpret, clock)
    report["wall_s"] = time.perf_counter() - start
    with open(args.json, "w") as f:
        json.dump(report, f, indent=1)
    print(f"[done] {report['wall_s']:.0f} s; results in {args.json}\n", flush=True)
    print(table(report))
    # JAX's own kernel is a baseline, not ours to pass: its rows inform, they do not fail.
    failed = any(r["status"] == "FAIL" or r["status"].startswith("error")
                 for r in [*(r for r in report["correctness"] if r["op"] != "jax_pallas_gpu"),
                           *report["fp8"]])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
