"""Build the serving state from a ServerConfig and run it under hypercorn (`xlaserve serve`).

Engines per model come from `[[models]] replicas`: "local" replicas are built by the factory
named in `engine` ("module:function", called with the ServedModel, returning an AsyncEngine or
an awaitable of one); "grpc://host:port" replicas are `RemoteEngine`s to an `xlaserve worker`.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import importlib
import inspect
import signal
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from hypercorn.asyncio import serve
from hypercorn.config import Config as HyperConfig

from xlaserve.serving.admission import AdmissionController
from xlaserve.serving.engine_api import AsyncEngine
from xlaserve.serving.http.app import create_app
from xlaserve.serving.http.state import ServingState
from xlaserve.serving.router import ModelGroup, Replica, Router
from xlaserve.serving.server_config import ServerConfig, load_config


def build_state(config: ServerConfig, engines: Mapping[str, Sequence[AsyncEngine]]
                ) -> ServingState:
    """`engines` maps each model's id (name@version) to its replicas, in config order."""
    groups = []
    for m in config.models:
        reps = list(engines[m.id])
        if not reps:
            raise ValueError(f"models[{m.id}]: no engine replicas")
        replicas = [Replica(f"{m.id}/{i}", e) for i, e in enumerate(reps)]
        def engine_rate(rs: list[Replica] = replicas) -> float:
            return sum(r.engine.service_rate() for r in rs)

        admission = AdmissionController(
            config.admission, capacity=m.max_inflight * len(replicas), max_queue=m.max_queue,
            replicas=len(replicas), engine_rate=engine_rate)
        groups.append(ModelGroup(m, replicas, admission, config.router))
    return ServingState(config, Router(groups, config.auto))


def _import(path: str) -> Any:
    module, _, name = path.partition(":")
    if not module or not name:
        raise ValueError(f"engine={path!r}: expected 'module:function'")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"engine={path!r} cannot be imported: {e}") from None


async def build_engines(config: ServerConfig) -> dict[str, list[AsyncEngine]]:
    from xlaserve.serving.grpc.client import RemoteEngine
    from xlaserve.serving.tokenizer import Tokenizer

    out: dict[str, list[AsyncEngine]] = {}
    for m in config.models:
        reps: list[AsyncEngine] = []
        for r in m.replicas:
            if r == "local":
                if not m.engine:
                    raise ValueError(f"models[{m.id}]: a 'local' replica needs engine = "
                                     "'module:function'")
                e = _import(m.engine)(m)
                e = await e if inspect.isawaitable(e) else e
                # a factory may return several replicas (one per mesh of engine_args.mesh)
                reps.extend(e if isinstance(e, (list, tuple)) else [e])
            else:
                # started (channel opened) by the app in its serving loop
                reps.append(RemoteEngine(r.removeprefix("grpc://"), m.name,
                                         Tokenizer.load(m.path)))
        out[m.id] = reps
    return out


def hypercorn_config(config: ServerConfig, port: int | None = None) -> HyperConfig:
    hc = HyperConfig()
    hc.bind = [f"{config.host}:{config.port if port is None else port}"]
    if config.tls_cert:
        hc.certfile, hc.keyfile = config.tls_cert, config.tls_key
    hc.accesslog = None
    hc.graceful_timeout = 5
    return hc


async def serve_async(config: ServerConfig, shutdown: asyncio.Event | None = None) -> None:
    engines = await build_engines(config)
    state = build_state(config, engines)
    shutdown = shutdown or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(sig, shutdown.set)
        except (NotImplementedError, RuntimeError):
            pass
    await serve(create_app(state), hypercorn_config(config),  # type: ignore[arg-type]
                shutdown_trigger=shutdown.wait)


def serve_main(argv: list[str] | None = None) -> int:
    """`xlaserve serve --config configs/smollm2.toml [--host H] [--port P]`."""
    p = argparse.ArgumentParser(prog="xlaserve serve")
    p.add_argument("--config", required=True, help="server config (.toml or .json)")
    p.add_argument("--host", help="override server.host")
    p.add_argument("--port", type=int, help="override server.port")
    p.add_argument("--mesh", help="device layout preset for every local model "
                                  "(e.g. configs/tp2.toml): sets engine_args.mesh")
    args = p.parse_args(argv)
    try:
        config = load_config(args.config)
        if args.mesh:
            config = dataclasses.replace(config, models=tuple(
                dataclasses.replace(m, engine_args={**m.engine_args, "mesh": args.mesh})
                for m in config.models))
        if args.host or args.port is not None:
            config = dataclasses.replace(config, host=args.host or config.host,
                                         port=config.port if args.port is None else args.port)
        asyncio.run(serve_async(config))
    except (ValueError, FileNotFoundError) as e:
        print(f"xlaserve serve: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0
