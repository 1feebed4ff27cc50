"""The persistent XLA compilation cache, on for every xlaserve command: a restarted server loads
its compiled buckets from disk instead of compiling them again."""

from __future__ import annotations

import os
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
