"""Engine configuration, composed: the scheduler's knobs (`scheduler`, each default in
SchedulerConfig), the bucket plan's lower bounds, the attention backend, the device mesh.

    EngineConfig.from_args(max_num_seqs=4, pipelined=False, mesh=MeshConfig(tensor=2))
        -> EngineConfig(scheduler=SchedulerConfig(max_num_seqs=4), pipelined=False, mesh=...)

`from_args` takes the flat keys `[[models]] engine_args` uses: a scheduler knob by its own name,
anything else an EngineConfig field; `with_args` changes some of them on a copy.  `speculative`
takes a SpeculativeConfig or its table (`{ method = "ngram", num_speculative_tokens = 4 }`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from typing import Any

from xlaserve.models.quantize import KV_DTYPES
from xlaserve.serving.runner.buckets import BucketPlan
from xlaserve.serving.scheduler.config import SchedulerConfig
from xlaserve.serving.speculative import SpeculativeConfig
from xlaserve.sharding.mesh import MeshConfig

_SCHEDULER_KEYS = frozenset(f.name for f in fields(SchedulerConfig))


@dataclass(frozen=True)
class EngineConfig:
    scheduler: SchedulerConfig = SchedulerConfig()  # noqa: RUF009 - frozen: one shared default
    min_step_tokens: int = 16            # smallest token bucket of a step that is not all decodes
    min_table_width: int = 4
    pipelined: bool = True               # schedule step n+1 while step n runs on device
    attention_backend: str = "auto"      # see kernels/attention.py: cpu kernels on CPU
    # The KV cache's dtype: "auto" = the model's; "int8" stores each token's K and V rows as
    # int8 with their scales (kernels/kv_quant.py: ~3.8x the tokens in the same bytes); "fp8"
    # the same rows as float8_e4m3fn (GPU only: refused on the CPU backend).
    kv_cache_dtype: str = "auto"
    seed: int = 0                        # seeds requests that bring none
    # Devices: each of `mesh.replicas` engines runs on its own `pipeline x tensor` mesh
    # (serving/loading.py loads the meshes and parameters, serving/engine/factory.py the engines).
    mesh: MeshConfig = MeshConfig()  # noqa: RUF009 - frozen, so one shared default is safe
    speculative: SpeculativeConfig | None = None   # draft tokens verified per step; None: off

    def __post_init__(self) -> None:
        s = self.scheduler
        if not isinstance(s, SchedulerConfig):
            raise TypeError(f"scheduler must be a SchedulerConfig, got {s!r}")
        if s.max_model_len % s.block_size:
            raise ValueError(f"max_model_len={s.max_model_len} must be a multiple of "
                             f"block_size={s.block_size}")
        if self.kv_cache_dtype not in ("auto", *KV_DTYPES):
            raise ValueError(f"kv_cache_dtype={self.kv_cache_dtype!r}: choose from "
                             f"{['auto', *KV_DTYPES]}")
        if not isinstance(self.mesh, MeshConfig):
            raise TypeError(f"mesh must be a sharding.mesh.MeshConfig, got {self.mesh!r}")
        if self.speculative is not None and not isinstance(self.speculative, SpeculativeConfig):
            raise TypeError(f"speculative must be a SpeculativeConfig, got {self.speculative!r}")
        self.bucket_plan  # validates the buckets' share

    @staticmethod
    def arg_names() -> frozenset[str]:
        """Every key `from_args` takes."""
        return _SCHEDULER_KEYS | {f.name for f in fields(EngineConfig)} - {"scheduler"}

    @classmethod
    def from_args(cls, args: Mapping[str, Any] | None = None, **kwargs: Any) -> EngineConfig:
        """From flat keys (see the module docstring); an unknown key is a ValueError naming
        it."""
        return cls().with_args(args, **kwargs)

    def with_args(self, args: Mapping[str, Any] | None = None, **kwargs: Any) -> EngineConfig:
        """A copy with the flat keys `args` / `kwargs` changed."""
        merged = {**(args or {}), **kwargs}
        unknown = sorted(set(merged) - self.arg_names())
        if unknown:
            raise ValueError(f"unknown engine setting(s) {unknown}; known: "
                             f"{sorted(self.arg_names())}")
        sched = {k: v for k, v in merged.items() if k in _SCHEDULER_KEYS}
        rest = {k: v for k, v in merged.items() if k not in _SCHEDULER_KEYS}
        if isinstance(rest.get("speculative"), Mapping):
            rest["speculative"] = SpeculativeConfig.from_dict(rest["speculative"])
        return replace(self, scheduler=replace(self.scheduler, **sched), **rest)

    @property
    def kv_dtype(self) -> str | None:
        """The runner's KV dtype (a jax dtype name: "fp8" is "float8_e4m3fn"): None for the
        model's own."""
        from xlaserve.models.quantize import kv_cache_dtype_name

        return None if self.kv_cache_dtype == "auto" else kv_cache_dtype_name(self.kv_cache_dtype)

    @property
    def bucket_plan(self) -> BucketPlan:
        return self.buckets_for(self.scheduler.max_num_batched_tokens)

    def buckets_for(self, max_tokens: int) -> BucketPlan:
        """The bucket plan of a runner whose steps feed up to `max_tokens` tokens."""
        s = self.scheduler
        return BucketPlan.for_limits(
            max_num_seqs=s.max_num_seqs, max_num_batched_tokens=max_tokens,
            max_width=s.max_blocks_per_seq, min_tokens=self.min_step_tokens,
            min_width=self.min_table_width, block_size=s.block_size)

    def runner_args(self, buckets: BucketPlan | None = None) -> dict[str, Any]:
        """ModelRunner's keyword arguments under this config (`buckets`: the bucket plan's)."""
        s = self.scheduler
        return {"num_blocks": s.num_kv_blocks, "block_size": s.block_size,
                "max_num_seqs": s.max_num_seqs, "buckets": buckets or self.bucket_plan,
                "attention_backend": self.attention_backend, "kv_dtype": self.kv_dtype}
