"""Load a model folder: config, parameters (into their shardings on a mesh) and tokenizer.

    load_model       one mesh (the default: every local device) -> LoadedModel
    load_replicas    EngineConfig.mesh = MeshConfig(pipeline=P, tensor=T, replicas=R)
                     -> make_replica_meshes: R disjoint P x T meshes (devices [r*P*T, (r+1)*P*T))
                     -> per mesh: parameters restored straight into its shardings
                        (checkpoints.store.load_params: each device reads its slice)

Replicas share nothing on device; they share the host-side ModelConfig and tokenizer.  The
engines over them are built in serving/engine/factory.py.

Multi-host (jax.distributed initialized, several processes): every process loads the same
replica; its mesh must cover devices of every process (`check_multihost_meshes`).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import jax
from jax.sharding import Mesh

from xlaserve.checkpoints.store import load_config, load_params
from xlaserve.models.config import ModelConfig
from xlaserve.models.llama import Params
from xlaserve.serving.engine.config import EngineConfig
from xlaserve.serving.tokenizer import Tokenizer
from xlaserve.sharding.mesh import make_mesh, make_replica_meshes

log = logging.getLogger(__name__)


@dataclass
class LoadedModel:
    config: ModelConfig
    params: Params
    tokenizer: Tokenizer
    mesh: Mesh


def load_model(folder: str | Path, *, dtype: str | None = None,
               quantization: str | None = None, mesh: Mesh | None = None) -> LoadedModel:
    mesh = mesh or make_mesh()
    config = load_config(folder, dtype, quantization)
    check_platform(config, folder, mesh.devices.flat[0].platform)
    return LoadedModel(config, load_params(folder, config, mesh), Tokenizer.load(folder), mesh)


def load_replicas(folder: str | Path, engine_config: EngineConfig, *, dtype: str | None = None,
                  quantization: str | None = None,
                  devices: Sequence[jax.Device] | None = None) -> list[LoadedModel]:
    """One LoadedModel per replica of `engine_config.mesh`, parameters placed on its mesh.

    Raises ValueError (with the numbers) when the devices do not suffice or the model cannot be
    laid out on the mesh, before reading any parameter."""
    meshes = make_replica_meshes(engine_config.mesh, devices)
    platform = meshes[0].devices.flat[0].platform
    config = load_config(folder, serving_dtype(dtype, platform), quantization)
    check_platform(config, folder, platform)
    tokenizer = Tokenizer.load(folder)
    if jax.process_count() > 1:
        check_multihost_meshes(engine_config, meshes)
    return [LoadedModel(config, load_params(folder, config, mesh), tokenizer, mesh)
            for mesh in meshes]


def check_platform(config: ModelConfig, folder: str | Path, platform: str) -> None:
    """fp8 weights are a GPU option (refused on CPU, kernels/quantized.py); a dtype other than
    float32 on the CPU is served, with a warning."""
    if config.quantization == "fp8":
        from xlaserve.kernels.quantized import check_fp8_platform

        check_fp8_platform(f"quantization='fp8' (model {folder})", platform)
    if config.dtype != "float32" and platform == "cpu":
        # Measured (BENCHMARKS.md, "dtypes on the CPU backend"): XLA:CPU runs bf16 scatters
        # as f32 over a converted copy of the whole operand, so every KV-cache write copies
        # the cache (~50x slower decode); its bf16/f16 dots are slower than f32 as well.
        log.warning("dtype %s on the CPU backend is slower than float32 (bfloat16 decode "
                    "steps ~50x, float16 ~1.3x); serve with --dtype float32 on CPU",
                    config.dtype)


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
