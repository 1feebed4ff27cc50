"""The persistent XLA compilation cache, on for every xlaserve command: a restarted server loads
its compiled buckets from disk instead of compiling them again."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

DEFAULT_DIR = Path.home() / ".cache" / "xlaserve" / "jax"


def enable_compilation_cache(path: str | Path | None = None) -> Path:
    """Cache every compiled executable under `path` (or $XLASERVE_COMPILE_CACHE, or
    ~/.cache/xlaserve/jax).  An explicit JAX_COMPILATION_CACHE_DIR is left as it is."""
    import jax

    if os.environ.get("JAX_COMPILATION_CACHE_DIR") and path is None:
        target = Path(os.environ["JAX_COMPILATION_CACHE_DIR"])
    else:
        target = Path(path or os.environ.get("XLASERVE_COMPILE_CACHE") or DEFAULT_DIR)
    target.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(target))
    # Each bucket compiles in about a second: cache them all, however quick.
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return target


@contextlib.contextmanager
def persistent_cache_off() -> Iterator[None]:
    """Compile without the persistent cache inside the block (every executable built by the
    backend), and use it again after.  jax decides whether a process uses the cache once, at
    its first compile, and keeps that answer: switching `jax_enable_compilation_cache` off
    later is not enough, so the cache is reset (to be decided again) on the way in and out."""
    import jax
    from jax.experimental.compilation_cache import compilation_cache

    previous = jax.config.jax_enable_compilation_cache  # type: ignore[attr-defined]
    jax.config.update("jax_enable_compilation_cache", False)
    compilation_cache.reset_cache()
    try:
        yield
    finally:
        jax.config.update("jax_enable_compilation_cache", previous)
        compilation_cache.reset_cache()
