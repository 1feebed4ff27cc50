"""The host bookkeeping packages never import jax (DESIGN.md boundaries)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = str(Path(__file__).resolve().parents[3])


def test_kv_cache_and_scheduler_do_not_import_jax() -> None:
    code = ("import sys\n"
            "import xlaserve.serving.kv_cache, xlaserve.serving.scheduler\n"
            "from xlaserve.serving.scheduler import Scheduler, SchedulerConfig\n"
            "Scheduler(SchedulerConfig())\n"
            "bad = sorted(m for m in sys.modules if m == 'jax' or m.startswith('jax.'))\n"
            "assert not bad, bad\n"
            "print('ok')\n")
    env = {**os.environ, "PYTHONPATH": REPO}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         check=False)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"
