"""Decode at batch 1 against the memory-bandwidth floor, both measured in the same process.

    bandwidth   a jitted elementwise pass over a large float32 array (read it, write a new one):
                2 * nbytes / time, median of several runs; on CPU also a numpy copy split
                over one thread per core (XLA's CPU loop may use one core while the model's
                matmuls use all), and the higher of the two counts
    floor       parameter bytes / bandwidth: a batch-1 decode step must read every weight once
    step        runner.run of one decode row + block on its token, median of ~20 steps of a
                sequence that was prefilled first (its KV is real)
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from xlaserve.models.llama import Params
from xlaserve.serving.runner.runner import ModelRunner
from xlaserve.serving.scheduler.step_plan import PENDING_TOKEN


@dataclass(frozen=True)
class Roofline:
    bandwidth_gb_s: float        # measured copy bandwidth, GB/s (1e9 bytes)
    param_bytes: int
    read_bytes: int              # what a batch-1 step must read: param_bytes less the input
                                 # embedding rows it does not look up (untied embeddings)
    floor_ms: float              # read_bytes / bandwidth
    step_ms: float               # median measured decode step at batch 1
    steps: int
    probes_gb_s: dict[str, float]  # every bandwidth probe; the highest is bandwidth_gb_s

    @property
    def ratio(self) -> float:
        """Measured step over the bandwidth floor (1.0 = at the floor)."""
        return self.step_ms / self.floor_ms

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "ratio": self.ratio}

    def describe(self) -> str:
        return (f"decode step at batch 1: {self.step_ms:.2f} ms (median of {self.steps}); "
                f"bandwidth floor {self.floor_ms:.2f} ms = {self.read_bytes / 2**20:.1f} MiB "
                f"of parameters read / {self.bandwidth_gb_s:.1f} GB/s measured ("
                + ", ".join(f"{k} {v:.1f}" for k, v in self.probes_gb_s.items()) + "); "
                f"ratio {self.ratio:.1f}x")


def param_bytes(params: Params) -> int:
    return int(sum(np.dtype(a.dtype).itemsize * int(np.prod(a.shape))
                   for a in jax.tree_util.tree_leaves(params)))


def decode_read_bytes(params: Params) -> int:
    """Parameter bytes one batch-1 decode step reads: all of them, except that an input
    embedding table that is not also the output head (an untied `lm_head`, or the packed
    `head` panels of the CPU kernels) is read one row at a time."""
    total = param_bytes(params)
    if "lm_head" not in params and "head" not in params:  # tied: read whole, as the head
        return total
    embed = params["embed"]
    rows, width = embed.shape
    return total - (rows - 1) * width * np.dtype(embed.dtype).itemsize


def median_seconds(fn: Callable[[], Any], repeats: int) -> float:
    """The median wall time of `repeats` calls of `fn`, after one untimed call."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def measure_bandwidth(nbytes: int = 512 << 20, repeats: int = 5) -> dict[str, float]:
    """Bytes read + written per second by one pass over a float32 array of `nbytes`, per
    probe ("jax", and on CPU "numpy_threads")."""
    probes = {"jax": _jax_pass_bandwidth(nbytes, repeats)}
    if jax.default_backend() == "cpu":
        probes["numpy_threads"] = threaded_copy_bandwidth(nbytes, repeats)
    return probes


def _jax_pass_bandwidth(nbytes: int, repeats: int) -> float:
    x = jnp.ones(nbytes // 4, jnp.float32)
    negate = jax.jit(lambda a: -a)        # not simplified away, unlike a copy or a * 1
    return 2 * x.nbytes / median_seconds(lambda: negate(x).block_until_ready(), repeats)


def thread_bounds(size: int) -> list[tuple[int, int]]:
    """[start, end) of one slice of range(size) per core (as even as integers allow)."""
    n = max(1, min(os.cpu_count() or 1, size))
    return [(size * i // n, size * (i + 1) // n) for i in range(n)]


def threaded_copy_bandwidth(nbytes: int, repeats: int = 5) -> float:
    """Bytes read + written per second by a numpy copy split over one thread per core."""
    src = np.ones(nbytes // 4, np.float32)
    dst = np.empty_like(src)
    bounds = thread_bounds(src.size)
    with ThreadPoolExecutor(len(bounds)) as pool:
        def copy() -> None:
            list(pool.map(lambda b: np.copyto(dst[b[0]:b[1]], src[b[0]:b[1]]), bounds))

        return 2 * src.nbytes / median_seconds(copy, repeats)


def decode_step_ms(runner: ModelRunner, prompt: tuple[int, ...], steps: int = 20,
                   first_block: int = 1) -> float:
    """Median ms of a batch-1 decode call after prefilling `prompt` (blocks taken from
    `first_block` on: the runner's KV must not be in use by anyone else)."""
    bs, buckets = runner.block_size, runner.buckets
    prompt = tuple(prompt[:buckets.max_tokens])
    total = len(prompt) + steps
    n_blocks = -(-total // bs)
    if first_block + n_blocks > runner.num_blocks:
        raise ValueError(f"decode probe needs {n_blocks} blocks, the runner has "
                         f"{runner.num_blocks}")
    table = list(range(first_block, first_block + n_blocks))
    width_max = buckets.table_widths[-1]
    if n_blocks > width_max:
        raise ValueError(f"decode probe of {total} tokens exceeds the widest table "
                         f"({width_max} blocks)")
    times = []
    try:   # the probe's token cell (owner "probe") is given back after
        call = runner.run([runner.row("probe", prompt, 0, table[:-(-len(prompt) // bs)])])
        call.out.tokens.block_until_ready()
        for k in range(steps):
            pos = len(prompt) + k
            row = runner.row("probe", (PENDING_TOKEN,), pos, table[:pos // bs + 1])
            start = time.perf_counter()
            call = runner.run([row])
            call.out.tokens.block_until_ready()
            times.append(time.perf_counter() - start)
    finally:
        runner.cells.release("probe")
    return 1e3 * float(np.median(times))


def measure_roofline(runner: ModelRunner, prompt: tuple[int, ...], steps: int = 20,
                     copy_bytes: int = 512 << 20) -> Roofline:
    step = decode_step_ms(runner, prompt, steps)
    probes = measure_bandwidth(copy_bytes)
    bw = max(probes.values())
    pb, read = param_bytes(runner.params), decode_read_bytes(runner.params)
    return Roofline(bw / 1e9, pb, read, 1e3 * read / bw, step, steps,
                    {k: v / 1e9 for k, v in probes.items()})
