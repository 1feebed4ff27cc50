"""The model runner: step plans in, sampled tokens out, over device-resident state.

    rows (host: token ids, positions, block tables, sampling params): every row of the step,
    decodes and prefill chunks alike, in one call
      -> one flat batch padded to a bucket (rows, tokens, width): HostStep, plain numpy arrays
         (tokens of row 0, row 1, ..., then padding; see buckets.py)
      -> [multi-host: process 0 broadcasts the HostStep; every process runs the same call]
      -> three int32 buffers (HostStep.packed: per row, per token, block tables), one transfer
         each, unpacked inside
      -> two AOT-compiled calls on the mesh (step_functions.py; inputs replicated on every
         device):
         forward  tokens[PENDING_TOKEN] <- token_cells[row_cell[row]]  (sampled last step)
                  logits, kv = forward(...)                 (kv donated: updated in place)
                  one device: models.llama.forward; a bigger mesh: the shard_map forward
                  (sharding/parallel_forward.py), logits [R, V] split over `tensor`
                  logits -> replicated [R, V]               (an all-gather of R x V floats)
         [host: the allowed-token masks of constrained rows, made while the forward runs]
         sample   out = sample(logits, mask)                (per-row seeded sampling)
                  token_cells[row_cell] <- out.tokens  (for the next step's PENDING_TOKEN)
      -> device arrays, fetched by the caller when it needs them

The forward is compiled per (rows, tokens, width) bucket, the sampler once per row count: the
sampler's sort costs about as much to compile as the whole scanned model, and depends on the
rows alone.

The runner owns the device KV cache (placed by sharding.layout.ShardLayout: layers over
`pipeline`, KV heads over `tensor`) and the token-cell array: both go into every call and come
back out.  Which sequence holds which token cell is the runner's too (`cells`,
token_cells.py).  Every bucket is compiled in `warmup()`; a shape outside the plan raises
instead of compiling, so serving never compiles.

Sampling gathers the vocab-split logits rather than sampling shard-locally: top-p needs a sort
over the whole vocabulary and logprobs a global log-sum-exp, and [R, V] float32 is small next to
a step's weights traffic (32 rows x 49152 x 4 B = 6 MiB at most), while a shard-local sampler
would need its own distributed top-k / top-p and could disagree with one device on ties.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from xlaserve.kernels.attention import check_model_backend, resolve_backend
from xlaserve.kernels.cpu import huge_pages
from xlaserve.models.config import ModelConfig
from xlaserve.models.kv_slots import slot_mapping
from xlaserve.models.llama import KVCache, Params, pack_params
from xlaserve.serving.runner.buckets import BucketPlan
from xlaserve.serving.runner.call_profile import CallProfile
from xlaserve.serving.runner.calls import CallResult, Forwarded
from xlaserve.serving.runner.host_step import (
    ROW_FIELDS,
    TOKEN_FIELDS,
    HostStep,
    lay_out,
    sample_rows,
)
from xlaserve.serving.runner.sampling import SampleOutput
from xlaserve.serving.runner.step_channel import Op, StepChannel
from xlaserve.serving.runner.step_functions import forward_step, sample_step
from xlaserve.serving.runner.token_cells import TokenCells
from xlaserve.serving.runner.token_mask import all_allowed, mask_as_bias, mask_words
from xlaserve.serving.scheduler.step_plan import ScheduledSeq
from xlaserve.serving.types import GREEDY, SamplingParams
from xlaserve.sharding.layout import ShardLayout
from xlaserve.sharding.parallel_forward import make_forward

log = logging.getLogger(__name__)


def log_backend(requested: str, chosen: str, platform: str, dtype: str) -> None:
    """Say at start-up which kernels serve, and why the CPU kernels do not when `auto` wanted
    them (once per runner: an engine builds one)."""
    if requested == "auto" and platform == "cpu" and chosen != "cpu":
        from xlaserve.kernels.cpu import build

        log.warning("attention backend: %s on %s, dtype %s (the CPU kernels are not available: "
                    "%s)", chosen, platform, dtype, build.load_error())
        return
    log.info("attention backend: %s on %s, dtype %s (requested %s)", chosen, platform, dtype,
             requested)


class ModelRunner:
    """Owns the device state of one model replica on one mesh and runs its compiled steps.

    The mesh decides everything: one device runs models.llama.forward; a `pipeline x tensor`
    mesh runs the shard_map forward with parameters and KV placed by ShardLayout.  A mesh that
    spans several processes (multi-host) is driven by process 0 (`run`); every other process
    calls `follow()` and launches the same calls with the inputs process 0 broadcasts."""

    def __init__(self, params: Params, config: ModelConfig, mesh: Mesh, *, num_blocks: int,
                 block_size: int, max_num_seqs: int, buckets: BucketPlan,
                 attention_backend: str = "auto", kv_dtype: str | None = None,
                 num_microbatches: int | None = None, peer_timeout_s: float = 60.0):
        self.config = config
        self.mesh = mesh
        self.layout = ShardLayout.create(config, mesh)   # ValueError if the model cannot fit
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.cells = TokenCells(max_num_seqs)   # which sequence's token is in which cell
        platform = mesh.devices.flat[0].platform
        self.backend = resolve_backend(attention_backend, platform)
        check_model_backend(config, self.backend)
        log_backend(attention_backend, self.backend, platform,
                    config.dtype + (f", {config.quantization} weights" if config.quantization
                                    else ""))
        # what serves, as /metrics labels it (xlaserve_engine_info)
        self.kernels = {"attention_backend": self.backend, "platform": platform,
                        "dtype": config.dtype, "quantization": config.quantization or "none"}
        # The CPU kernels read only each row's real blocks: one table width serves every step.
        self.buckets = buckets.single_width() if self.backend == "cpu" else buckets
        self.replicated = NamedSharding(mesh, PartitionSpec())
        # Already placed parameters (checkpoints.store.load_params) stay where they are; host or
        # differently placed ones are moved to the layout's shardings once, here.
        self.params = self.layout.shard_params(params, mesh)
        # Panels for the CPU kernels, which run float32 (other dtypes take the jnp path, which
        # would unpack them at every call).
        self.packed = (self.backend == "cpu" and mesh.devices.size == 1
                       and jnp.dtype(config.dtype) == jnp.float32)
        if self.packed:
            self.params = pack_params(self.params)   # weight panels for the CPU kernels
            huge_pages.advise(self.params)
        sharded = mesh.devices.size > 1
        fwd = make_forward(config, mesh, num_microbatches=num_microbatches)
        kv_sharding = self.layout.kv_sharding(mesh)
        self.kv_dtype = kv_dtype
        self._jitted = jax.jit(
            functools.partial(forward_step, forward=fwd, config=config,
                              backend=self.backend,
                              replicated=self.replicated if sharded else None),
            donate_argnames=("kv",),
            out_shardings=(KVCache(kv_sharding, kv_sharding), self.replicated))
        self._jitted_sample = jax.jit(
            sample_step, donate_argnames=("token_cells",),
            out_shardings=(self.replicated,
                           SampleOutput(*[self.replicated] * len(SampleOutput._fields))))
        # Multi-host: process 0 broadcasts every call's inputs (and resets) to the others.
        self.channel = None if self.replicated.is_fully_addressable else \
            StepChannel(config.vocab_size, timeout_s=peer_timeout_s)
        self._zero_bias: dict[int, jax.Array] = {}
        self._no_mask: dict[int, jax.Array] = {}
        self._compiled: dict[tuple[int, int, int], Any] = {}
        self._compiled_sample: dict[int, Any] = {}
        self.warmup_seconds = 0.0
        # Set to a CallProfile to time every call per bucket (each call is then waited for).
        self.profile: CallProfile | None = None
        self._fresh_state()

    @property
    def is_leader(self) -> bool:
        """Does this process schedule (always, unless the mesh spans processes)?"""
        return self.channel is None or self.channel.is_leader

    def reset_state(self) -> None:
        """Fresh device state: an all-zero KV cache and token cells (after a failed call may
        have consumed the donated buffers).  On a multi-host mesh every process resets."""
        if self.channel is not None:
            self._require_leader("reset_state")
            self.channel.send(Op.RESET)
        self._fresh_state()

    def _fresh_state(self) -> None:
        self.kv = self.layout.init_kv_cache(self.mesh, self.num_blocks, self.block_size,
                                            self.kv_dtype)
        if self.backend == "cpu":
            huge_pages.advise(self.kv)
        (self.token_cells,) = self._put(np.zeros(self.max_num_seqs + 1, np.int32))

    # -- compilation ---------------------------------------------------------------------------

    def _abstract_args(self, r: int, t: int, w: int
                       ) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
        def spec(shape: tuple[int, ...], dtype: Any) -> jax.ShapeDtypeStruct:
            return jax.ShapeDtypeStruct(shape, dtype, sharding=self.replicated)

        i32 = jnp.int32
        rows = spec((len(ROW_FIELDS), r), i32)
        forward_args = (self.params, self.kv, self.token_cells, rows,
                        spec((len(TOKEN_FIELDS), t), i32), spec((r, w), i32))
        v = self.config.vocab_size
        sample_args = (spec((r, v), jnp.float32), self.token_cells, rows,
                       spec((r, v), jnp.float32), spec((r, mask_words(v)), i32),
                       spec((r, v), jnp.float32))
        return forward_args, sample_args

    def compile(self, shape: tuple[int, int, int]) -> Any:
        """The forward pass for bucket (rows, tokens, width), and the sampler for its rows."""
        r = shape[0]
        forward_args, sample_args = self._abstract_args(*shape)
        if shape not in self._compiled:
            self._compiled[shape] = self._jitted.lower(*forward_args).compile()
        if r not in self._compiled_sample:
            self._compiled_sample[r] = self._jitted_sample.lower(*sample_args).compile()
        return self._compiled[shape]

    def warmup(self, shapes: Sequence[tuple[int, int, int]] | None = None) -> float:
        """Compile every bucket (or `shapes`); returns the seconds it took.  On a multi-host
        mesh every process calls it (the broadcasts of each bucket's inputs are warmed up too,
        which are collectives)."""
        start = time.perf_counter()
        shapes = list(shapes if shapes is not None else self.buckets.shapes())
        for shape in shapes:
            self.compile(shape)
        if self.channel is not None:
            self.channel.warmup(shapes)
        self.warmup_seconds += time.perf_counter() - start
        return self.warmup_seconds

    @property
    def compiled_shapes(self) -> list[tuple[int, int, int]]:
        return sorted(self._compiled)

    # -- execution -----------------------------------------------------------------------------

    def forward(self, rows: Sequence[ScheduledSeq],
                bias: Mapping[str, np.ndarray] | None = None,          # [V] per request id
                draft_probs: Mapping[str, np.ndarray] | None = None,   # [num_draft, V] each
                ) -> Forwarded:
        """Launch the forward over `rows` (decodes and prefill chunks alike, in their order);
        `sample` launches its sampler.  In between the host may make the allowed-token masks of
        constrained rows while the device runs the forward.  On a multi-host mesh the step is
        laid out only: it goes to every process whole, masks included, in `sample`.  `bias`
        and `draft_probs`, by request id: see `host_step.lay_out`."""
        host = self.host_step(rows, bias, draft_probs)
        order = sample_rows([row.num_draft for row in rows])
        start = time.perf_counter()
        if self.channel is not None:
            self._require_leader("forward")
            return Forwarded(host, order, start)
        return Forwarded(host, order, start, *self._launch_forward(host))

    def sample(self, call: Forwarded, masks: np.ndarray | None = None) -> CallResult:
        """Launch the sampler of `call`: its tokens go to the rows' token cells for the next
        step.  `masks`: the rows' allowed-token masks [len(rows), ceil(V/32)] int32
        (token_mask.py), None = every token allowed."""
        host = call.host
        if self.channel is not None:   # the masks fold into the bias, which the channel carries
            if masks is not None:
                host = host._replace(bias=mask_as_bias(self._pad_mask(masks, host.shape[0]),
                                                       host.bias, self.config.vocab_size))
                masks = None
            self.channel.send(Op.STEP, host)
            call = Forwarded(host, call.sample_rows, call.started, *self._launch_forward(host))
        assert call.rows is not None and call.logits is not None
        out = self._launch_sample(host, call.rows, call.logits, masks)
        if self.profile is not None:
            jax.block_until_ready(out.tokens)      # serialises the pipeline: diagnostics only
            self.profile.record(host.shape, time.perf_counter() - call.started,
                                int((host.token_rows >= 0).sum()))
        return CallResult(sum(len(o) for o in call.sample_rows), out, host.shape,
                          call.sample_rows)

    def run(self, rows: Sequence[ScheduledSeq], masks: np.ndarray | None = None) -> CallResult:
        """One call over `rows`, forward and sampler (`forward`, then `sample`)."""
        return self.sample(self.forward(rows), masks)

    def follow(self) -> int:
        """On a process other than 0 of a multi-host mesh: launch every call process 0 sends,
        until it calls `close()`.  Returns the number of calls run.  Raises PeerTimeout or the
        collective's error when process 0 stops answering."""
        if self.channel is None or self.channel.is_leader:
            raise RuntimeError("follow() is for processes other than 0 of a multi-host mesh")
        calls = 0
        while True:
            op, host = self.channel.receive()
            if op is Op.STOP:
                jax.block_until_ready(self.kv)
                return calls
            if op is Op.RESET:
                self._fresh_state()
                continue
            assert host is not None
            self._launch_sample(host, *self._launch_forward(host))
            calls += 1

    def close(self) -> None:
        """Process 0 of a multi-host mesh: release the followers from `follow()`."""
        if self.channel is not None and self.channel.is_leader:
            self.channel.send(Op.STOP)

    def _require_leader(self, what: str) -> None:
        if not self.is_leader:
            raise RuntimeError(f"{what}: only process 0 drives a multi-host mesh; process "
                               f"{jax.process_index()} must call follow()")

    def row(self, owner: str, token_ids: Sequence[int], start_position: int,
            block_table: Sequence[int], sample: bool = True, sampling: SamplingParams = GREEDY,
            sample_index: int = 0) -> ScheduledSeq:
        """A row made by hand (the draft proposer, calibration, benchmarks), as the scheduler
        would plan it.  `owner` stands for the request: a call gives it a token cell
        (`cells`), which its caller releases when done."""
        n = len(token_ids)
        return ScheduledSeq(owner, tuple(token_ids), start_position, tuple(block_table),
                            slot_mapping(block_table, start_position, n, self.block_size),
                            sample, sampling=sampling, sample_index=sample_index)

    def bucket(self, rows: Sequence[ScheduledSeq]) -> tuple[int, int, int]:
        """The (rows, tokens, width) bucket a call over `rows` runs in: one sample row per
        plan row, and one more per draft token of a verify row."""
        if not rows:
            raise ValueError("a call needs at least one row")
        return self.buckets.fit(len(rows) + sum(row.num_draft for row in rows),
                                sum(row.num_tokens for row in rows),
                                max(len(row.block_table) for row in rows))

    def host_step(self, rows: Sequence[ScheduledSeq],
                  bias: Mapping[str, np.ndarray] | None = None,          # [V] per request id
                  draft_probs: Mapping[str, np.ndarray] | None = None,   # [num_draft, V] each
                  ) -> HostStep:
        """Lay `rows` out as one flat batch padded to its bucket: the host arrays of one call.
        Each row's token cell is its request's (`cells`: taken on first use)."""
        shape = self.bucket(rows)
        if shape not in self._compiled:
            r, t, w = shape
            raise RuntimeError(f"bucket (rows={r}, tokens={t}, width={w}) was not compiled in "
                               f"warm-up; compiled: {len(self._compiled)} buckets")
        cells = [self.cells.cell(row.request_id) for row in rows]
        return lay_out(rows, cells, shape, self.block_size, self.config.vocab_size, bias,
                       draft_probs)

    def _launch_forward(self, host: HostStep) -> tuple[Any, jax.Array]:
        """Launch the compiled forward of `host` (asynchronously); the KV cache advances.
        Returns the packed rows as the call took them and the logits [R, V]."""
        rows, toks, tables = self._step_inputs(*host.packed())
        self.kv, logits = self._compiled[host.shape](self.params, self.kv, self.token_cells,
                                                     rows, toks, tables)
        self._forwarded(host, rows, logits)
        return rows, logits

    def _launch_sample(self, host: HostStep, rows: Any, logits: jax.Array,
                       mask: np.ndarray | None = None) -> SampleOutput:
        """Launch the compiled sampler of `host` over `logits`; the token cells advance."""
        r = host.shape[0]
        bias = self._step_inputs(host.bias)[0] if host.bias is not None else self._zeros_bias(r)
        allowed = self._step_inputs(self._pad_mask(mask, r))[0] if mask is not None else \
            self._all_allowed(r)
        q = self._step_inputs(host.draft_probs)[0] if host.draft_probs is not None else \
            self._zeros_bias(r)   # unread: no row has a draft_token
        self.token_cells, out = self._compiled_sample[r](
            logits, self.token_cells, rows, bias, allowed, q)
        return out

    def _forwarded(self, host: HostStep, rows: jax.Array, logits: jax.Array) -> None:
        """Called with each call's logits [R, V] once its forward is launched (a draft model's
        runner takes its distributions from them: draft_runner.py)."""

    def _pad_mask(self, mask: np.ndarray, r: int) -> np.ndarray:
        """A [rows, W] mask padded to the bucket's r rows (padding rows: everything allowed)."""
        out = all_allowed(r, self.config.vocab_size)
        out[: mask.shape[0]] = mask
        return out

    def _all_allowed(self, r: int) -> jax.Array:
        if r not in self._no_mask:
            self._no_mask[r] = self._put(all_allowed(r, self.config.vocab_size))[0]
        return self._no_mask[r]

    def _step_inputs(self, *arrays: np.ndarray) -> list[np.ndarray | jax.Array]:
        """One call's host arrays as its compiled calls take them.  On one device, the numpy
        arrays themselves, which the call takes in, in C++, ~0.4 ms a step sooner than a
        device_put ahead of it (BENCHMARKS.md, "The step's inputs as numpy"); host_step makes
        them afresh for every call and nothing writes them after.  On a mesh, replicated
        device arrays (`_put`)."""
        return list(arrays) if self.mesh.devices.size == 1 else self._put(*arrays)

    def _put(self, *arrays: np.ndarray) -> list[jax.Array]:
        """Host arrays replicated on every device of the mesh, in one transfer call (only this
        process's devices are written: on a multi-host mesh every process holds the same
        arrays)."""
        if self.replicated.is_fully_addressable:
            return list(jax.device_put(list(arrays), self.replicated))
        return [jax.make_array_from_callback(a.shape, self.replicated, lambda index, a=a: a[index])
                for a in arrays]

    def _zeros_bias(self, r: int) -> jax.Array:
        if r not in self._zero_bias:
            self._zero_bias[r] = self._put(np.zeros((r, self.config.vocab_size), np.float32))[0]
        return self._zero_bias[r]
