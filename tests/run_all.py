"""Run the whole suite in three pytest processes: the kernel, model and checkpoint tests beside
the multi-device tests (eight forced host devices: XLA_FLAGS must be set before jax is
imported, so they cannot share a process with the rest), then the rest of the single-device
tests alone (the system tests hold timing bounds a loaded machine could break).

Two single-device processes, not one, keep each one's live XLA:CPU executables (about four
memory maps each) far below vm.max_map_count, which one process holding the whole suite's once
reached.  The first pair shares the two cores: most of their time is XLA compiling, one thread
per compile, so side by side they take little more than the longer of the two.  Each of the
pair gets one torch thread (OMP_NUM_THREADS=1): torch's two OpenMP threads, one of them on the
core the other process holds, made transformers' reference decoding 3x slower with one core
busy (64 greedy tokens of SmolLM2: 3.7 s on one thread, 11.1 s on two; in the suite its 320
tokens took 139 s)."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

TESTS = Path(__file__).resolve().parent
MULTI = TESTS / "multidevice"
FIRST = [TESTS / name for name in ("checkpoints", "kernels", "models", "sharding")]


def start(args: list[str], env: dict[str, str], **kw) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "pytest", *args]
    print("+", " ".join(cmd), flush=True)
    return subprocess.Popen(cmd, env=env, cwd=TESTS.parent, **kw)


def main() -> int:
    extra = ["--durations=20", *sys.argv[1:]]
    env = dict(os.environ)
    pair_env = dict(env, OMP_NUM_THREADS="1")
    multi_env = dict(pair_env, XLA_FLAGS=(env.get("XLA_FLAGS", "") +
                                          " --xla_force_host_platform_device_count=8").strip())
    with tempfile.TemporaryFile("w+") as multi_log:   # printed whole once it ends
        multi = start([str(MULTI), *extra], multi_env, stdout=multi_log,
                      stderr=subprocess.STDOUT) if any(MULTI.glob("test_*.py")) else None
        rc = start([*map(str, FIRST), *extra], pair_env).wait()
        if multi is not None:
            rc = multi.wait() or rc
            multi_log.seek(0)
            print(multi_log.read(), flush=True)
    rest = [arg for path in (*FIRST, MULTI) for arg in ("--ignore", str(path))]
    # run them even after a failure: report everything
    return start([str(TESTS), *rest, *extra], env).wait() or rc


if __name__ == "__main__":
    sys.exit(main())
