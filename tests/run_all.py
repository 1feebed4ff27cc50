"""Run the whole suite: the single-device tests in two pytest processes (the kernel, model and
checkpoint tests, then the rest), then the multi-device tests in a third with eight forced host
devices (XLA_FLAGS must be set before jax is imported, so they cannot share a process with the
rest).  Two single-device processes, not one, keep each one's live XLA:CPU executables (about
four memory maps each) far below vm.max_map_count, which one process holding the whole suite's
once reached."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent
MULTI = TESTS / "multidevice"
FIRST = [TESTS / name for name in ("checkpoints", "kernels", "models", "sharding")]


def pytest(args: list[str], env: dict[str, str]) -> int:
    cmd = [sys.executable, "-m", "pytest", *args]
    print("+", " ".join(cmd), flush=True)
    return subprocess.call(cmd, env=env, cwd=TESTS.parent)


def main() -> int:
    extra = ["--durations=20", *sys.argv[1:]]
    env = dict(os.environ)
    rc = pytest([*map(str, FIRST), *extra], env)
    rest = [arg for path in (*FIRST, MULTI) for arg in ("--ignore", str(path))]
    rc = pytest([str(TESTS), *rest, *extra], env) or rc  # run them even after a failure
    if any(MULTI.glob("test_*.py")):  # run them even after a failure: report everything
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") +
                            " --xla_force_host_platform_device_count=8").strip()
        rc = pytest([str(MULTI), *extra], env) or rc
    return rc


if __name__ == "__main__":
    sys.exit(main())
