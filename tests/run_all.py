"""Run the whole suite: the single-device tests in one pytest process, then the multi-device
tests in a second process with eight forced host devices (XLA_FLAGS must be set before jax is
imported, so they cannot share a process with the rest)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent
MULTI = TESTS / "multidevice"


def pytest(args: list[str], env: dict[str, str]) -> int:
    cmd = [sys.executable, "-m", "pytest", *args]
    print("+", " ".join(cmd), flush=True)
    return subprocess.call(cmd, env=env, cwd=TESTS.parent)


def main() -> int:
    extra = ["--durations=20", *sys.argv[1:]]
    env = dict(os.environ)
    rc = pytest([str(TESTS), "--ignore", str(MULTI), *extra], env)
    if any(MULTI.glob("test_*.py")):  # run them even after a failure: report everything
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") +
                            " --xla_force_host_platform_device_count=8").strip()
        rc = pytest([str(MULTI), *extra], env) or rc
    return rc


if __name__ == "__main__":
    sys.exit(main())
