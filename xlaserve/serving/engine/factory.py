"""Every engine comes from here: `xlaserve serve` (HTTP), `xlaserve worker` (gRPC), a
multi-host job's followers and `xlaserve generate` all build theirs with these functions.

    [[models]] table (ServedModel)
      -> local_engines        its `engine` factory ("module:function"; the default is
                              `threaded_engines`), awaited when it returns an awaitable
      -> threaded_engines     engine_args -> `engine_config`, then `build_engines`, each
                              LLMEngine wrapped in a ThreadedEngine (not warmed up: each
                              compiles its buckets on its own thread once started)
      -> build_engines        serving/loading.py `load_replicas`: one LoadedModel per mesh
                              replica; per replica a ModelRunner (`make_runner`) + LLMEngine

On a multi-host job every process calls this with the same config: process 0 gets the engine it
serves with, the others the same runner, to `follow()`.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import jax

from xlaserve.serving.engine.config import EngineConfig
from xlaserve.serving.engine.engine import LLMEngine
from xlaserve.serving.engine.threaded_engine import ThreadedEngine
from xlaserve.serving.engine_api import AsyncEngine
from xlaserve.serving.loading import LoadedModel, load_replicas
from xlaserve.serving.runner.runner import ModelRunner
from xlaserve.serving.server_config import BUILTIN_ENGINE, ServedModel
from xlaserve.sharding.mesh import MeshConfig


def engine_config(engine_args: Mapping[str, Any]) -> EngineConfig:
    """A [[models]] table's `engine_args` (EngineConfig.from_args keys; `mesh` is a table
    {pipeline, tensor, replicas} or the path of a preset such as configs/tp2.toml)."""
    args = dict(engine_args)
    mesh = args.get("mesh")   # a file name, a table, a MeshConfig, or None (the default)
    if isinstance(mesh, str):
        args["mesh"] = MeshConfig.load(mesh)
    elif isinstance(mesh, dict):
        args["mesh"] = MeshConfig.from_dict(mesh)
    elif mesh is None:
        args.pop("mesh", None)
    return EngineConfig.from_args(args)


def make_runner(model: LoadedModel, config: EngineConfig) -> ModelRunner:
    """The runner an engine under `config` builds for `model` (benchmarks drive it alone)."""
    return ModelRunner(model.params, model.config, model.mesh, **config.runner_args())


def build_engines(folder: str | Path, config: EngineConfig, *, dtype: str | None = None,
                  quantization: str | None = None,
                  devices: Sequence[jax.Device] | None = None,
                  warmup: bool = True) -> list[LLMEngine]:
    """`config.mesh.replicas` engines serving the model in `folder`, each on its own mesh,
    every bucket compiled (unless `warmup=False`)."""
    engines = []
    for model in load_replicas(folder, config, dtype=dtype, quantization=quantization,
                               devices=devices):
        engines.append(LLMEngine(model.params, model.config, model.tokenizer, model.mesh,
                                 config))
        if warmup:
            engines[-1].warmup()
    return engines


def threaded_engines(served: ServedModel) -> list[ThreadedEngine]:
    """The built-in engine factory (a [[models]] table without `engine`): the model folder
    `served.path` in `served.dtype` (loading.serving_dtype) and `served.quantization`, one
    continuous-batching engine per mesh replica of `served.engine_args`, each on its own
    thread."""
    engines = build_engines(served.path, engine_config(served.engine_args), dtype=served.dtype,
                            quantization=served.quantization, warmup=False)
    return [ThreadedEngine(e, model_name=served.name) for e in engines]


async def local_engines(served: ServedModel) -> list[AsyncEngine]:
    """What `served`'s factory (`engine`, "module:function", default `threaded_engines`)
    builds: one engine, or several (one per mesh of engine_args.mesh)."""
    factory = threaded_engines if served.engine == BUILTIN_ENGINE else _import(served.engine)
    built = factory(served)
    built = await built if inspect.isawaitable(built) else built
    return list(built) if isinstance(built, (list, tuple)) else [built]


def _import(path: str) -> Any:
    module, _, name = path.partition(":")
    if not module or not name:
        raise ValueError(f"engine={path!r}: expected 'module:function'")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"engine={path!r} cannot be imported: {e}") from None
