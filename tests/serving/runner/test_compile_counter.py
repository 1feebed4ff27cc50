"""The compile counter that the "serving never compiles" tests read counts what it claims: a
fresh shape is a compile, and an executable loaded from the persistent cache (a restarted
server's buckets) is counted too, as a cache load."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp

from xlaserve.compile_cache import persistent_cache_off
from xlaserve.serving.runner.compile_counter import CompileCounter

ROOT = Path(__file__).resolve().parents[3]

# A fresh process (the persistent cache is configured once per process): compile, forget the
# in-memory executables, compile the same function again from the cache on disk.
CACHE_RUN = """
import json, sys
import jax, jax.numpy as jnp
from xlaserve.compile_cache import enable_compilation_cache
from xlaserve.serving.runner.compile_counter import CompileCounter

enable_compilation_cache(sys.argv[1])
f = jax.jit(lambda x: jnp.sin(x) * 3.0 + 1.0)
x = jnp.ones((37,), jnp.float32)
with CompileCounter() as first:
    f(x).block_until_ready()
jax.clear_caches()
with CompileCounter() as again:
    f(x).block_until_ready()
print(json.dumps([first.compiles, first.cache_loads, again.compiles, again.cache_loads]))
"""


def test_a_fresh_shape_is_counted_and_a_seen_one_is_not() -> None:
    f = jax.jit(lambda x: x * 2.0 + 0.5)
    # The inputs are made outside the counters (jnp.ones runs jitted code of its own), and the
    # persistent cache is off: an earlier run's executable on disk would make it a cache load.
    ones, zeros = jnp.ones((3, 41), jnp.float32), jnp.zeros((3, 41), jnp.float32)
    with persistent_cache_off():
        with CompileCounter() as fresh:
            f(ones).block_until_ready()
        with CompileCounter() as seen:
            f(zeros).block_until_ready()
    assert fresh.compiles >= 1 and fresh.count == fresh.compiles, vars(fresh)
    assert seen.count == 0, vars(seen)


def test_a_persistent_cache_load_is_counted(tmp_path) -> None:
    out = subprocess.run([sys.executable, "-c", CACHE_RUN, str(tmp_path / "cache")], cwd=ROOT,
                         capture_output=True, text=True, timeout=300, check=True)
    first_compiles, first_loads, again_compiles, again_loads = json.loads(
        out.stdout.strip().splitlines()[-1])
    assert first_compiles >= 1 and first_loads == 0
    assert again_loads >= 1 and again_compiles == 0
