"""From one model folder to R engines, each on its own mesh, as EngineConfig.mesh says.

    EngineConfig(mesh=MeshConfig(pipeline=P, tensor=T, replicas=R))
      -> make_replica_meshes      R disjoint P x T meshes (devices [r*P*T, (r+1)*P*T))
      -> load_replicas            per mesh: parameters restored straight into its shardings
                                  (checkpoints.store.load_params: each device reads its slice)
      -> build_engines            per replica: ModelRunner (KV placed by the layout, warmed up)
                                  + LLMEngine; the router spreads requests over them

Replicas share nothing on device; they share the host-side ModelConfig and tokenizer.

Multi-host (jax.distributed initialized, several processes): every process runs this with the
same config and gets the same engine; the mesh must cover devices of every process (process 0
schedules and broadcasts each step, the others follow), and one engine drives the whole job.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import jax
from jax.sharding import Mesh

from xlaserve.checkpoints.store import load_config, load_params
from xlaserve.serving.engine.config import EngineConfig
from xlaserve.serving.engine.engine import LLMEngine
from xlaserve.serving.loading import LoadedModel
from xlaserve.serving.runner.runner import ModelRunner
from xlaserve.serving.tokenizer import Tokenizer
from xlaserve.sharding.mesh import make_replica_meshes


def load_replicas(folder: str | Path, engine_config: EngineConfig, *, dtype: str | None = None,
                  quantization: str | None = None,
                  devices: Sequence[jax.Device] | None = None) -> list[LoadedModel]:
    """One LoadedModel per replica of `engine_config.mesh`, parameters placed on its mesh.

    Raises ValueError (with the numbers) when the devices do not suffice or the model cannot be
    laid out on the mesh, before reading any parameter."""
    meshes = make_replica_meshes(engine_config.mesh, devices)
    config = load_config(folder, serving_dtype(dtype, meshes[0].devices.flat[0].platform),
                         quantization)
    tokenizer = Tokenizer.load(folder)
    if jax.process_count() > 1:
        check_multihost_meshes(engine_config, meshes)
    return [LoadedModel(config, load_params(folder, config, mesh), tokenizer, mesh)
            for mesh in meshes]


def serving_dtype(dtype: str | None, platform: str) -> str | None:
    """The weight dtype to serve in: "auto" is float32 on the CPU (XLA:CPU's bfloat16 is
    slower, BENCHMARKS.md) and bfloat16 on an accelerator (half the bytes a step reads); None
    keeps the model folder's; anything else is taken as it is."""
    if dtype != "auto":
        return dtype
    return "float32" if platform == "cpu" else "bfloat16"


def check_multihost_meshes(engine_config: EngineConfig, meshes: Sequence[Mesh]) -> None:
    """On a job of several processes: one replica whose mesh covers every process (its steps
    are broadcast to all of them; two engines would interleave their broadcasts)."""
    n = jax.process_count()
    m = engine_config.mesh
    layout = f"pipeline={m.pipeline} x tensor={m.tensor} x replicas={m.replicas}"
    if len(meshes) != 1:
        raise ValueError(f"mesh {layout}: a job of {n} processes serves one replica whose mesh "
                         f"spans them all; set replicas = 1")
    processes = sorted({d.process_index for d in meshes[0].devices.flat})
    if len(processes) != n:
        raise ValueError(f"mesh {layout} covers the devices of processes {processes} only; a "
                         f"job of {n} processes ({jax.device_count()} devices, "
                         f"{jax.local_device_count()} per process) needs a mesh over every "
                         f"process's devices")


def make_runner(model: LoadedModel, engine_config: EngineConfig) -> ModelRunner:
    """The runner an engine under `engine_config` builds for `model` (benchmarks drive it
    alone)."""
    return ModelRunner(model.params, model.config, model.mesh, **engine_config.runner_args())


def build_engines(folder: str | Path, engine_config: EngineConfig, *, dtype: str | None = None,
                  quantization: str | None = None,
                  devices: Sequence[jax.Device] | None = None,
                  warmup: bool = True) -> list[LLMEngine]:
    """`engine_config.mesh.replicas` engines serving the model in `folder`, each on its own
    mesh, every bucket compiled (unless `warmup=False`)."""
    engines = []
    for model in load_replicas(folder, engine_config, dtype=dtype, quantization=quantization,
                               devices=devices):
        engines.append(LLMEngine(model.params, model.config, model.tokenizer, model.mesh,
                                 engine_config))
        if warmup:
            engines[-1].warmup()
    return engines
