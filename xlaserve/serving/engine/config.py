"""Engine configuration: scheduler limits, KV pool, buckets, attention backend, device mesh."""

from __future__ import annotations

from dataclasses import dataclass

from xlaserve.serving.runner.buckets import BucketPlan
from xlaserve.serving.scheduler.config import SchedulerConfig
from xlaserve.sharding.mesh import MeshConfig


@dataclass(frozen=True)
class EngineConfig:
    max_model_len: int = 2048
    block_size: int = 16
    num_kv_blocks: int = 2048            # including the null block 0
    max_num_seqs: int = 32               # decode rows per step
    max_num_batched_tokens: int = 1024   # token budget per step
    max_prefill_chunk: int = 512         # most prompt tokens one sequence gets per step
    min_step_tokens: int = 16            # smallest token bucket of a step that is not all decodes
    min_table_width: int = 4
    aging_seconds: float = 30.0
    enable_prefix_caching: bool = True
    pipelined: bool = True               # schedule step n+1 while step n runs on device
    attention_backend: str = "auto"      # see kernels/attention.py: cpu kernels on CPU
    seed: int = 0                        # seeds requests that bring none
    # Devices: each of `mesh.replicas` engines runs on its own `pipeline x tensor` mesh
    # (serving/engine/replicas.py builds the meshes, parameters and engines).
    mesh: MeshConfig = MeshConfig()  # noqa: RUF009 - frozen, so one shared default is safe

    def __post_init__(self) -> None:
        if self.max_model_len % self.block_size:
            raise ValueError(f"max_model_len={self.max_model_len} must be a multiple of "
                             f"block_size={self.block_size}")
        if not isinstance(self.mesh, MeshConfig):
            raise TypeError(f"mesh must be a sharding.mesh.MeshConfig, got {self.mesh!r}")
        self.scheduler_config  # validates the scheduler's share
        self.bucket_plan

    @property
    def scheduler_config(self) -> SchedulerConfig:
        return SchedulerConfig(
            num_kv_blocks=self.num_kv_blocks, block_size=self.block_size,
            max_num_seqs=self.max_num_seqs, max_num_batched_tokens=self.max_num_batched_tokens,
            max_prefill_chunk=self.max_prefill_chunk, max_model_len=self.max_model_len,
            aging_seconds=self.aging_seconds, enable_prefix_caching=self.enable_prefix_caching)

    @property
    def bucket_plan(self) -> BucketPlan:
        return BucketPlan.for_limits(
            max_num_seqs=self.max_num_seqs, max_num_batched_tokens=self.max_num_batched_tokens,
            max_width=self.max_model_len // self.block_size, min_tokens=self.min_step_tokens,
            min_width=self.min_table_width, block_size=self.block_size)
