"""`xlaserve bench startup`: load and compile time of the model, next to a shallow variant.

    full     load_params (orbax restore of the model folder), then compile one decode bucket
             (1 row, with its sampler) and one prefill bucket (1 row x chunk tokens)
    variant  the same config with `variant_layers` layers and random parameters, saved to a
             temporary orbax checkpoint and restored the same way, then the same two buckets

Layers run under lax.scan, so compile time should barely move with depth while load time
scales with bytes.  The persistent compilation cache is switched off for the measurement (and
each compile is checked to be a real backend compile, not a cache load).
"""

from __future__ import annotations

import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import jax

from xlaserve.bench.report import markdown_table, write_json
from xlaserve.bench.roofline import param_bytes
from xlaserve.checkpoints.store import load_config, load_params, save_params
from xlaserve.compile_cache import persistent_cache_off
from xlaserve.models.config import ModelConfig
from xlaserve.models.llama import init_params
from xlaserve.serving.runner.buckets import BucketPlan
from xlaserve.serving.runner.compile_counter import CompileCounter
from xlaserve.serving.runner.runner import ModelRunner
from xlaserve.sharding.mesh import make_mesh


@dataclass(frozen=True)
class StartupRow:
    name: str
    layers: int
    param_mib: float
    load_s: float               # orbax restore into the mesh's shardings
    decode_compile_s: float     # bucket (1, 1, width), its sampler included
    prefill_compile_s: float    # bucket (1, chunk, width)
    decode_bucket: tuple[int, int, int]
    prefill_bucket: tuple[int, int, int]


def _timed_compile(runner: ModelRunner, shape: tuple[int, int, int]) -> float:
    with CompileCounter() as c:
        start = time.perf_counter()
        runner.compile(shape)
        seconds = time.perf_counter() - start
    if c.compiles == 0:
        raise RuntimeError(f"bucket {shape} was not compiled by the backend "
                           f"({c.cache_loads} cache loads): the measurement would be void")
    return seconds


def measure(name: str, folder: Path, config: ModelConfig, chunk: int, width: int,
            block_size: int = 16) -> StartupRow:
    mesh = make_mesh()
    start = time.perf_counter()
    params = load_params(folder, config, mesh)
    jax.block_until_ready(params)
    load_s = time.perf_counter() - start
    plan = BucketPlan(row_sizes=(1,), token_sizes=(chunk,), table_widths=(width,),
                      block_size=block_size)
    runner = ModelRunner(params, config, mesh, num_blocks=width + 1, block_size=block_size,
                         max_num_seqs=1, buckets=plan)
    decode, prefill = (1, 1, width), (1, chunk, width)
    decode_s = _timed_compile(runner, decode)
    prefill_s = _timed_compile(runner, prefill)
    return StartupRow(name, config.num_layers, param_bytes(params) / 2**20, load_s, decode_s,
                      prefill_s, decode, prefill)


def run_startup(model_dir: str | Path, variant_layers: int = 2, chunk: int = 128,
                width: int = 16) -> list[StartupRow]:
    if variant_layers < 1:
        raise ValueError(f"--variant-layers {variant_layers} must be >= 1")
    if chunk > width * 16:
        raise ValueError(f"--chunk {chunk} does not fit a table of {width} blocks of 16")
    model_dir = Path(model_dir)
    config = load_config(model_dir)
    with persistent_cache_off():
        rows = [measure(f"{model_dir.name}", model_dir, config, chunk, width)]
        variant = config.first_layers(variant_layers)
        with tempfile.TemporaryDirectory(prefix="xlaserve-startup-") as tmp:
            save_params(Path(tmp), init_params(variant))
            rows.append(measure(f"{variant_layers}-layer variant (random)", Path(tmp),
                                variant, chunk, width))
    return rows


def format_rows(rows: list[StartupRow]) -> str:
    head = ("model", "layers", "params MiB", "load s", "decode compile s", "prefill compile s")
    body = [(r.name, str(r.layers), f"{r.param_mib:.1f}", f"{r.load_s:.2f}",
             f"{r.decode_compile_s:.2f}", f"{r.prefill_compile_s:.2f}") for r in rows]
    r0 = rows[0]
    note = (f"buckets: decode {r0.decode_bucket} (includes its 1-row sampler), prefill "
            f"{r0.prefill_bucket}; persistent compilation cache off")
    return markdown_table(head, body) + "\n" + note


def startup_main(model_dir: str, variant_layers: int, chunk: int, width: int,
                 json_out: str | None) -> int:
    rows = run_startup(model_dir, variant_layers, chunk, width)
    print(format_rows(rows), flush=True)
    if json_out:
        write_json(json_out, {"rows": [asdict(r) for r in rows], "jax": jax.__version__})
    return 0
