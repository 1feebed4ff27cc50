"""Build, load and register the native CPU kernels (C++ against XLA's FFI headers).

    sources  native/*.cc + *.h  (this package)
       -> g++ -O3 -march=native -shared  (jax.ffi.include_dir() for the FFI headers)
       -> <cache>/<key>/libxlaserve_cpu.so     key = hash of the sources, compiler, flags, jaxlib
                                               version and this CPU's ISA flags
       -> ctypes.CDLL, jax.ffi.register_ffi_target for every handler in HANDLERS

`make kernels` (a step of `make serve` and `make test`) runs `python -m xlaserve.kernels.cpu.build`,
so a fresh machine builds it during set-up; `load()` builds on first use when the cached library
is missing, so an installed package works without the Makefile too.  A build takes ~8 s on the
2-core development box; finding the cached one, a few milliseconds.  The cache is `$XLASERVE_KERNEL_CACHE`, else ~/.cache/xlaserve/kernels: outside the
source tree, so a clean clone never finds a stale library next to the code.

When no compiler is found, or the build fails (another ISA, old headers), `load()` returns
None with the reason in `load_error()`; the attention dispatch then resolves `auto` to the
jnp path and the engine logs why once at start-up.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)

NATIVE_DIR = Path(__file__).parent / "native"
LIBRARY_NAME = "libxlaserve_cpu.so"
FLAGS = ("-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-DNDEBUG",
         "-Wall", "-Wno-unknown-pragmas")
# FFI target name -> exported handler symbol, both named for the backend they run on (cpu), so
# an HLO dump or a profile says which backend's kernel a custom call is.
HANDLERS = {
    "xlaserve_cpu_matmul": "XlaserveCpuMatmul",
    "xlaserve_cpu_matmul_packed": "XlaserveCpuMatmulPacked",
    "xlaserve_cpu_matmul_packed_normed": "XlaserveCpuMatmulPackedNormed",
    "xlaserve_cpu_matmul_packed_gated": "XlaserveCpuMatmulPackedGated",
    "xlaserve_cpu_matmul_packed_add": "XlaserveCpuMatmulPackedAdd",
    "xlaserve_cpu_matmul_nt": "XlaserveCpuMatmulNt",
    "xlaserve_cpu_paged_attention": "XlaserveCpuPagedAttention",
    "xlaserve_cpu_rope_kv_write": "XlaserveCpuRopeKvWrite",
    "xlaserve_cpu_top_k": "XlaserveCpuTopK",
}


def cache_root() -> Path:
    env = os.environ.get("XLASERVE_KERNEL_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "xlaserve" / "kernels"


def compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++") \
        or shutil.which("clang++")


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def _sources() -> list[Path]:
    return sorted(p for p in NATIVE_DIR.iterdir() if p.suffix in (".cc", ".h"))


def build_key(cxx: str) -> str:
    import jaxlib

    h = hashlib.sha256()
    for p in _sources():
        h.update(p.name.encode() + b"\0" + p.read_bytes())
    h.update(" ".join((cxx, *FLAGS, jaxlib.__version__, platform.machine(),
                       _cpu_flags())).encode())
    return h.hexdigest()[:16]


def build(force: bool = False) -> Path:
    """Compile the library into the cache (unless there already); returns its path.
    Raises RuntimeError with the compiler's output when the build fails."""
    import jax

    cxx = compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler found (set CXX, or install g++)")
    target = cache_root() / build_key(cxx) / LIBRARY_NAME
    if target.exists() and not force:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    sources = [str(p) for p in _sources() if p.suffix == ".cc"]
    # Build beside the target and rename: concurrent builders (test processes) never see a
    # half-written library.
    fd, tmp = tempfile.mkstemp(dir=target.parent, suffix=".so.tmp")
    os.close(fd)
    cmd = [cxx, *FLAGS, f"-I{jax.ffi.include_dir()}", f"-I{NATIVE_DIR}", *sources, "-o", tmp]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        os.unlink(tmp)
        raise RuntimeError(f"building the CPU kernels failed ({' '.join(cmd)}):\n"
                           f"{proc.stderr.strip()[-4000:]}")
    os.replace(tmp, target)
    log.info("built CPU kernels: %s", target)
    return target


@functools.cache
def _load() -> tuple[ctypes.CDLL | None, str | None]:
    import jax

    if platform.system() != "Linux":
        return None, f"the CPU kernels are built for Linux only (this is {platform.system()})"
    try:
        lib = ctypes.CDLL(str(build()))
        for name, symbol in HANDLERS.items():
            jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(getattr(lib, symbol)),
                                        platform="cpu")
    except (RuntimeError, OSError, AttributeError) as e:
        return None, str(e)
    return lib, None


def load() -> ctypes.CDLL | None:
    """The loaded library with every handler registered, or None when it cannot be built."""
    return _load()[0]


def load_error() -> str | None:
    """Why `load()` returned None (None when it did not)."""
    return _load()[1]


def matmul_tile_n() -> int:
    """Columns per packed weight panel (kernels/matmul.py): 3 vectors of the ISA built for."""
    lib = load()
    if lib is None:
        raise RuntimeError(f"the CPU kernels are not available: {load_error()}")
    lib.xlaserve_cpu_matmul_tile_n.restype = ctypes.c_int64
    return int(lib.xlaserve_cpu_matmul_tile_n())


def main() -> int:
    try:
        path = build(force="--force" in sys.argv)
    except RuntimeError as e:
        print(f"CPU kernels not built: {e}", file=sys.stderr)
        return 0 if "--optional" in sys.argv else 1
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
