"""Build the serving state from a ServerConfig and run it under hypercorn (`xlaserve serve`).

Engines per model come from `[[models]] replicas`: "local" replicas are built by
serving/engine/factory.py (`local_engines`: the built-in engines, or the factory a table names
in `engine`, "module:function", called with the ServedModel, returning an AsyncEngine or an
awaitable of one); "grpc://host:port" replicas are `RemoteEngine`s to an `xlaserve worker`,
dialled as the `[grpc]` table says (TLS, client certificate, token: serving/grpc/auth.py).

Multi-host: a `[distributed]` table in the config file (or XLASERVE_COORDINATOR /
XLASERVE_NUM_PROCESSES / XLASERVE_PROCESS_ID, see sharding/distributed.py) makes every host run
the same `xlaserve serve` command as one jax job whose mesh spans them:

    process 0                                   process k > 0
    initialize(), build the engine              initialize(), build the same engine
    HTTP front + scheduler; each step is        no HTTP: warm up the same buckets, then
      broadcast to the followers ─────────────>   ThreadedEngine.follow() until process 0 closes
    SIGTERM: drain (see below), release followers -> exit 0
    a failed step (peer died): every request   process 0 died: the next collective raises
      gets an error, serving stops, exit 1        -> log, exit 1

SIGINT/SIGTERM drain before hypercorn closes (`drain_trigger`): /ready and new requests answer
503 with Retry-After, running requests get `server.drain_timeout_s` (default 30 s) to finish,
and any still running then end with an explicit "server shutting down" error.

A peer that dies while process 0 is idle fails no collective; jax's coordination service
notices its missing heartbeat after `heartbeat_timeout_s` and aborts the survivors (their log
names the silent process).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import signal
import sys
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

from hypercorn.asyncio import serve
from hypercorn.config import Config as HyperConfig

from xlaserve.serving.admission import AdmissionController
from xlaserve.serving.config_file import load_serve_config, with_model_overrides
from xlaserve.serving.disagg.workers import (
    LAYOUT_SOURCE,
    SpawnedWorkers,
    refuse_multiprocess,
    worker_commands,
)
from xlaserve.serving.engine_api import AsyncEngine, ServiceCosts
from xlaserve.serving.http.app import create_app
from xlaserve.serving.http.state import ServingState
from xlaserve.serving.router import ModelGroup, Replica, Router
from xlaserve.serving.server_config import ServerConfig, replica_target
from xlaserve.sharding.distributed import (
    DistributedConfig,
    PeerFailure,
    exit_now,
    initialize,
    is_multiprocess,
)

log = logging.getLogger(__name__)
SPAWN_TIMEOUT_S = 600.0   # how long a spawned worker may take to load its model


def build_state(config: ServerConfig, engines: Mapping[str, Sequence[AsyncEngine]]
                ) -> ServingState:
    """`engines` maps each model's id (name@version) to its replicas, in config order."""
    groups = []
    for m in config.models:
        reps = list(engines[m.id])
        if not reps:
            raise ValueError(f"models[{m.id}]: no engine replicas")
        replicas = [Replica(f"{m.id}/{i}", e) for i, e in enumerate(reps)]

        def live_costs(rs: list[Replica] = replicas) -> list[ServiceCosts]:
            return [r.engine.service_costs() for r in rs if r.engine.ready]

        admission = AdmissionController(config.admission, m.max_inflight, m.max_queue,
                                        live_costs)
        groups.append(ModelGroup(m, replicas, admission, config.router))
    return ServingState(config, Router(groups, config.auto))


async def build_model_engines(config: ServerConfig) -> dict[str, list[AsyncEngine]]:
    from xlaserve.serving.disagg.engine import DisaggregatedEngine
    from xlaserve.serving.engine.factory import local_engines
    from xlaserve.serving.grpc.auth import channel_credentials
    from xlaserve.serving.grpc.client import RemoteEngine
    from xlaserve.serving.tokenizer import Tokenizer

    # every worker's credentials first: a missing file or token fails before any engine loads
    credentials = {r: channel_credentials(config.grpc, replica_target(r))
                   for m in config.models for r in m.replicas if r != "local"}
    out: dict[str, list[AsyncEngine]] = {}
    for m in config.models:
        reps: list[AsyncEngine] = []
        split: dict[str, list[RemoteEngine]] = {"prefill": [], "decode": []}
        for r in m.replicas:
            if r == "local":
                reps.extend(await local_engines(m))
            else:
                # started (channel opened) by the app in its serving loop
                # a worker this server spawns is waited for while it loads the model
                remote = RemoteEngine(replica_target(r), m.name, Tokenizer.load(m.path),
                                      credentials=credentials[r],
                                      connect_timeout=SPAWN_TIMEOUT_S if m.spawn_workers
                                      else 30.0)
                scheme = r.split("://", 1)[0]
                (split[scheme] if scheme in split else reps).append(remote)
        if split["prefill"]:
            reps.append(DisaggregatedEngine(split["prefill"], split["decode"], m.name,
                                            int(m.engine_args.get("block_size", 16))))
        out[m.id] = reps
    return out


def hypercorn_config(config: ServerConfig, port: int | None = None) -> HyperConfig:
    hc = HyperConfig()
    hc.bind = [f"{config.host}:{config.port if port is None else port}"]
    if config.tls_cert:
        hc.certfile, hc.keyfile = config.tls_cert, config.tls_key
    hc.accesslog = None
    hc.graceful_timeout = 5
    if any(m.spawn_workers for m in config.models):   # start-up waits for the workers
        hc.startup_timeout = SPAWN_TIMEOUT_S
    return hc


class EngineFailure(RuntimeError):
    """A local engine can never serve (its warm-up failed): the server stops."""


def multihost_engine(engines: Mapping[str, Sequence[AsyncEngine]]) -> Any:
    """On a job of several processes: the one local engine, whose mesh spans them all."""
    local = [e for reps in engines.values() for e in reps if hasattr(e, "spans_processes")]
    if len(local) != 1 or not local[0].spans_processes:
        raise ValueError(f"a multi-host server drives exactly one local engine whose mesh spans "
                         f"every process; this config builds {len(local)} local engine(s) "
                         f"for models {sorted(engines)}")
    return local[0]


def drain_trigger(state: ServingState, shutdown: asyncio.Event) -> Callable[[], Awaitable[None]]:
    """hypercorn's shutdown trigger: once `shutdown` is set, drain the serving state (running
    requests finish or end with an explicit error) before hypercorn closes the connections."""
    async def trigger() -> None:
        await shutdown.wait()
        stopped = await state.drain(state.config.drain_timeout_s)
        if stopped:
            log.warning("shutdown: stopped %d request(s) still running after %g s",
                        stopped, state.config.drain_timeout_s)
    return trigger


async def serve_async(config: ServerConfig, shutdown: asyncio.Event | None = None) -> None:
    """Serve until `shutdown` is set (or SIGINT/SIGTERM).  Raises PeerFailure when an engine
    on a multi-host mesh failed for good, EngineFailure when a local engine's warm-up failed
    (after answering the requests held and stopping)."""
    engines = await build_model_engines(config)
    state = build_state(config, engines)
    shutdown = shutdown or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(sig, shutdown.set)
        except (NotImplementedError, RuntimeError):
            pass
    failures: list[str] = []

    async def stop_on_failure(engine: Any) -> None:
        error = await engine.wait_failed()
        failures.append(error)
        where = "process 0: " if is_multiprocess() else ""
        print(f"xlaserve serve: {where}stopping the server: {error}", file=sys.stderr,
              flush=True)
        shutdown.set()

    watchers = []
    if is_multiprocess():
        watchers.append(asyncio.ensure_future(stop_on_failure(multihost_engine(engines))))
    else:   # a local engine whose warm-up failed would leave the server up, never ready
        watchers += [asyncio.ensure_future(stop_on_failure(e)) for reps in engines.values()
                     for e in reps if hasattr(e, "wait_failed")]
    try:
        await serve(create_app(state), hypercorn_config(config),  # type: ignore[arg-type]
                    shutdown_trigger=drain_trigger(state, shutdown))
    finally:
        for w in watchers:
            w.cancel()
    if failures:
        raise (PeerFailure if is_multiprocess() else EngineFailure)(failures[0])


def follow_main(config: ServerConfig) -> int:
    """A process other than 0: build the same engine, follow process 0 until it closes."""
    import jax

    pid, n = jax.process_index(), jax.process_count()
    engine = multihost_engine(asyncio.run(build_model_engines(config)))
    print(f"xlaserve serve: process {pid} of {n}: following process 0 "
          f"({engine.model_name}, {jax.device_count()} devices)", file=sys.stderr, flush=True)
    try:
        calls = engine.follow()
    except Exception as e:  # noqa: BLE001 - process 0 or another peer is gone
        print(f"xlaserve serve: process {pid}: lost the mesh (process 0 or another peer died "
              f"or stopped answering): {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        exit_now(1)
    print(f"xlaserve serve: process {pid}: process 0 closed the mesh after {calls} steps",
          file=sys.stderr, flush=True)
    return 0


def serve_main(argv: list[str] | None = None) -> int:
    """`xlaserve serve --config configs/smollm2.toml [--host H] [--port P]`."""
    p = argparse.ArgumentParser(prog="xlaserve serve")
    p.add_argument("--config", required=True, help="server config (.toml or .json)")
    p.add_argument("--host", help="override server.host")
    p.add_argument("--port", type=int, help="override server.port")
    p.add_argument("--mesh", help="device layout preset for every local model "
                                  "(e.g. configs/tp2.toml): sets engine_args.mesh")
    p.add_argument("--dtype", help="weight dtype of every model (auto | float32 | bfloat16 | "
                                   "float16; auto: float32 on CPU, bfloat16 on GPU): sets "
                                   "models.dtype")
    args = p.parse_args(argv)
    distributed: DistributedConfig | None = None
    try:
        config, table = load_serve_config(args.config)
        layout = DistributedConfig.resolve(table)
        if layout is not None:   # before joining the job: a plain exit
            refuse_multiprocess(config, layout.num_processes, LAYOUT_SOURCE)
        distributed = layout
        config = with_model_overrides(config, mesh=args.mesh, dtype=args.dtype)
        if args.host or args.port is not None:
            config = dataclasses.replace(config, host=args.host or config.host,
                                         port=config.port if args.port is None else args.port)
        if distributed is not None:
            initialize(distributed)   # before any device use: jax.devices() spans the job
            if distributed.process_id != 0:
                return follow_main(config)
        with SpawnedWorkers(worker_commands(args.config, config)):
            asyncio.run(serve_async(config))
    except (PeerFailure, EngineFailure) as e:
        print(f"xlaserve serve: error: {e}", file=sys.stderr)
        if isinstance(e, PeerFailure):
            exit_now(1)   # not jax's exit handler: it would wait for the dead peer
        return 1
    except (ValueError, FileNotFoundError) as e:
        print(f"xlaserve serve: error: {e}", file=sys.stderr)
        if distributed is not None:
            exit_now(2)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0
