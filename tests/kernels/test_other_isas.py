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


MARCHES = {"x86-64-v3": {"avx2", "fma"}, "x86-64-v2": set()}


@pytest.fixture(scope="module")
def children(tmp_path_factory) -> dict[str, tuple[subprocess.Popen, Path]]:
    """Both builds' child pytest runs, started at once (each is mostly one g++ or one Python
    thread, so on two cores the pair takes about as long as one): march -> (process, log)."""
    started = {}
    for march, needs in MARCHES.items():
        if not needs <= cpu_flags():
            continue
        tmp = tmp_path_factory.mktemp(march)
        cxx = tmp / "cxx"
        cxx.write_text(f'#!/bin/sh\nexec g++ "$@" -march={march}\n')
        cxx.chmod(0o755)
        env = {**os.environ, "CXX": str(cxx), "XLASERVE_KERNEL_CACHE": str(tmp / "cache")}
        log = tmp / "pytest.log"
        with log.open("w") as out:
            proc = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-x", "-p",
                                     "no:cacheprovider", *TESTS], cwd=ROOT, env=env,
                                    stdout=out, stderr=subprocess.STDOUT, text=True)
        started[march] = (proc, log)
    yield started
    for proc, _ in started.values():
        if proc.poll() is None:
            proc.kill()


@pytest.mark.skipif(platform.machine() != "x86_64" or shutil.which("g++") is None,
                    reason="the -march levels below are x86-64's, built with g++")
@pytest.mark.parametrize("march,needs", list(MARCHES.items()))
def test_kernels_built_for_another_vector_width_match_the_references(children, march, needs):
    if not needs <= cpu_flags():
        pytest.skip(f"this CPU cannot run -march={march} code (lacks {needs - cpu_flags()})")
    proc, log = children[march]
    returncode = proc.wait(timeout=900)
    stdout = log.read_text()
    assert returncode == 0, stdout[-6000:]
    assert " passed" in stdout and "skipped" not in stdout.splitlines()[-1]
