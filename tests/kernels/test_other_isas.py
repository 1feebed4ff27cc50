"""The native kernels built for the vector widths this host is not: simd.h's AVX2 path (8 lanes,
16 registers: the Zen 3 boxes) and its portable 4-lane path (what NEON or SSE hosts build), each
compiled in a child process (`CXX` = g++ with a later -march, which overrides the build's
-march=native) and run through the attention and matmul kernel tests against their references.
A path no test built went unnoticed before: the 4-lane exp did not compile."""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TESTS = ["tests/kernels/test_ragged_attention.py::test_cpu_kernel_matches_reference",
         ("tests/kernels/test_ragged_attention.py::test_cpu_kernel_reads_16_bit_caches_as_the_"
          "reference_does"),
         ("tests/kernels/test_ragged_attention.py::test_cpu_kernel_widens_every_16_bit_pattern_"
          "exactly"),
         "tests/kernels/test_kv_quant.py", "tests/kernels/test_matmul.py"]


def cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    return set(line.split(":", 1)[-1].split())


@pytest.mark.skipif(platform.machine() != "x86_64" or shutil.which("g++") is None,
                    reason="the -march levels below are x86-64's, built with g++")
@pytest.mark.parametrize("march,needs", [("x86-64-v3", {"avx2", "fma"}),
                                         ("x86-64-v2", set())])
def test_kernels_built_for_another_vector_width_match_the_references(tmp_path, march, needs):
    if not needs <= cpu_flags():
        pytest.skip(f"this CPU cannot run -march={march} code (lacks {needs - cpu_flags()})")
    cxx = tmp_path / "cxx"
    cxx.write_text(f'#!/bin/sh\nexec g++ "$@" -march={march}\n')
    cxx.chmod(0o755)
    env = {**os.environ, "CXX": str(cxx), "XLASERVE_KERNEL_CACHE": str(tmp_path / "cache")}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                          *TESTS], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=900)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert " passed" in run.stdout and "skipped" not in run.stdout.splitlines()[-1]
