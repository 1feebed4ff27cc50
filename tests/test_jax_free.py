"""The host-only packages' tests (scheduler, KV-cache bookkeeping, admission, routing,
speculative proposers, the split's prefill pick) pass in
an interpreter where jax cannot be imported, as in a venv without it: a `sitecustomize` on the
path refuses every `jax` / `jaxlib` import, and pytest runs those test folders under it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HOST_ONLY = ["tests/serving/scheduler", "tests/serving/kv_cache", "tests/serving/admission",
             "tests/serving/router", "tests/serving/speculative",
             "tests/serving/runner/test_host_step.py",
             "tests/serving/runner/test_token_cells.py", "tests/serving/disagg/test_affinity.py"]

NO_JAX = '''import sys


class NoJax:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("jax", "jaxlib"):
            raise ImportError(f"no module named {name!r} (this interpreter has no jax)")
        return None


sys.meta_path.insert(0, NoJax())
'''


def test_host_only_tests_pass_without_jax(tmp_path: Path) -> None:
    (tmp_path / "sitecustomize.py").write_text(NO_JAX)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}
    probe = subprocess.run([sys.executable, "-c", "import jax"], env=env, capture_output=True,
                           text=True, check=False)
    assert probe.returncode != 0 and "has no jax" in probe.stderr, probe.stderr
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          *HOST_ONLY], env=env, cwd=ROOT, capture_output=True, text=True,
                         check=False, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    assert " passed" in out.stdout and "error" not in out.stdout.splitlines()[-1]
