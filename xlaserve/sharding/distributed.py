"""Several processes, one mesh: start jax's distributed runtime and broadcast with a deadline.

    process 0 (coordinator)                 process 1 .. n-1
    initialize(DistributedConfig)           initialize(DistributedConfig)   # same address
    jax.devices() = every process's devices; a mesh over them spans the processes
    broadcast_from_process0(x)   ──────>    broadcast_from_process0(zeros like x) -> x

Settings come from a `[distributed]` TOML table (coordinator, num_processes, process_id, ...)
and/or the environment (XLASERVE_COORDINATOR, XLASERVE_NUM_PROCESSES, XLASERVE_PROCESS_ID,
XLASERVE_HEARTBEAT_TIMEOUT_S; jax's own JAX_COORDINATOR_ADDRESS, ... also work).  A variable
that is set wins over the table's key, so every host can read one file and set only its
XLASERVE_PROCESS_ID.

Failure: jax's coordination service checks every process's heartbeat; one that stops beating
for `heartbeat_timeout_s` fails the whole job (jax logs "tasks are unhealthy (stopped sending
heartbeats): <ids>" and aborts the survivors).  Within a step, a collective whose peer died
raises from the collective library at once, and `broadcast_from_process0` gives up after
`timeout_s` with PeerTimeout rather than waiting forever on a peer that hangs.  A process that
saw a peer fail leaves with `exit_now`: jax's own exit handler would wait at a shutdown barrier
for the dead peer.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import jax

ENV_PREFIX = "XLASERVE_"


class PeerTimeout(RuntimeError):
    """A collective across processes did not finish in time: a peer died or hangs."""


class PeerFailure(RuntimeError):
    """A process of a multi-host job died or stopped answering: the job cannot go on."""


@dataclass(frozen=True)
class DistributedConfig:
    coordinator_address: str      # host:port where process 0 runs the coordination service
    num_processes: int
    process_id: int               # this process, in [0, num_processes)
    heartbeat_timeout_s: int = 10  # a silent process fails the job after this long
    initialization_timeout_s: int = 120
    cpu_collectives: str = "gloo"  # CPU devices' cross-process collectives (tests, CPU hosts)

    def __post_init__(self) -> None:
        for name, kind in (("coordinator_address", str), ("num_processes", int),
                           ("process_id", int), ("heartbeat_timeout_s", int),
                           ("initialization_timeout_s", int), ("cpu_collectives", str)):
            value = getattr(self, name)
            if not isinstance(value, kind) or isinstance(value, bool):
                raise ValueError(  # noqa: TRY004 - a config error, reported as one
                    f"[distributed] {name}={value!r}: expected {kind.__name__}, "
                    f"got {type(value).__name__}")
        if self.num_processes < 1:
            raise ValueError(f"num_processes must be an int >= 1, got {self.num_processes!r}")
        if not 0 <= self.process_id < self.num_processes:
            raise ValueError(f"process_id={self.process_id!r} must be in "
                             f"[0, num_processes={self.num_processes})")
        host, _, port = self.coordinator_address.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"coordinator_address={self.coordinator_address!r} must be "
                             f"host:port")
        for name in ("heartbeat_timeout_s", "initialization_timeout_s"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1 second, got {getattr(self, name)}")
        if self.cpu_collectives not in ("gloo", "mpi"):
            raise ValueError(f"cpu_collectives={self.cpu_collectives!r}: gloo or mpi")

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> DistributedConfig:
        """A `[distributed]` table; `coordinator` is short for `coordinator_address`."""
        d = dict(d)
        if "coordinator" in d:
            if "coordinator_address" in d:
                raise ValueError("[distributed]: give coordinator or coordinator_address, "
                                 "not both")
            d["coordinator_address"] = d.pop("coordinator")
        known = set(cls.__dataclass_fields__)
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown [distributed] keys {sorted(unknown)}; known: "
                             f"coordinator, {sorted(known)}")
        missing = {"coordinator_address", "num_processes", "process_id"} - set(d)
        if missing:
            raise ValueError(f"[distributed] needs {sorted(missing)} (or their variables "
                             f"{sorted(ENV_PREFIX + ENV_KEYS[k] for k in missing)})")
        return cls(**d)

    @classmethod
    def resolve(cls, table: Mapping[str, Any] | None = None,
                env: Mapping[str, str] | None = None) -> DistributedConfig | None:
        """The `[distributed]` table with every key whose variable is set in `env` (default:
        os.environ) replaced by the variable's value; None when neither names a coordinator
        (a single-process server)."""
        env = os.environ if env is None else env
        merged = dict(table or {})
        if "coordinator" in merged and "coordinator_address" not in merged:
            merged["coordinator_address"] = merged.pop("coordinator")
        for key, ours in ENV_KEYS.items():
            value = env.get(ENV_PREFIX + ours) or (env.get(JAX_ENV[key]) if key in JAX_ENV
                                                   else None)
            if value:
                try:
                    merged[key] = value if key == "coordinator_address" else int(value)
                except ValueError:
                    raise ValueError(f"{ENV_PREFIX + ours}={value!r} is not an integer") \
                        from None
        if not merged.get("coordinator_address"):
            if merged:
                raise ValueError(f"[distributed] {sorted(merged)} given but no coordinator: "
                                 f"set coordinator or {ENV_PREFIX}COORDINATOR")
            return None
        return cls.from_dict(merged)


# DistributedConfig field -> the XLASERVE_ variable that sets it (and jax's own name, if any).
ENV_KEYS = {"coordinator_address": "COORDINATOR", "num_processes": "NUM_PROCESSES",
            "process_id": "PROCESS_ID", "heartbeat_timeout_s": "HEARTBEAT_TIMEOUT_S"}
JAX_ENV = {"coordinator_address": "JAX_COORDINATOR_ADDRESS",
           "num_processes": "JAX_NUM_PROCESSES", "process_id": "JAX_PROCESS_ID"}


def initialize(config: DistributedConfig | None = None) -> bool:
    """Join the distributed runtime (before any other jax call).  `config` None reads the
    environment; returns False (and does nothing) when neither names a coordinator."""
    config = config or DistributedConfig.resolve()
    if config is None:
        return False
    jax.config.update("jax_cpu_collectives_implementation", config.cpu_collectives)
    jax.distributed.initialize(
        coordinator_address=config.coordinator_address, num_processes=config.num_processes,
        process_id=config.process_id, initialization_timeout=config.initialization_timeout_s,
        heartbeat_timeout_seconds=config.heartbeat_timeout_s)
    return True


def is_multiprocess() -> bool:
    """Has this process joined a job of several processes?  (Touches no device unless
    jax.distributed was initialized.)"""
    return jax.distributed.is_initialized() and jax.process_count() > 1


def exit_now(code: int) -> None:
    """Leave at once with `code`, after flushing output, skipping jax's exit handler (its
    distributed shutdown waits at a barrier for every process, including a dead one)."""
    import logging

    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def broadcast_from_process0(tree: Any, timeout_s: float | None) -> Any:
    """Every process passes arrays of the same shapes; all get process 0's values (numpy).

    One jitted all-reduce per distinct tree of shapes (compiled the first time: warm it up).
    With `timeout_s`, raises PeerTimeout when the collective has not finished by then; the
    stuck collective is abandoned, so the caller must treat the mesh as broken."""
    from jax.experimental.multihost_utils import broadcast_one_to_all

    if timeout_s is None:
        return broadcast_one_to_all(tree)
    result: list[Any] = []
    error: list[BaseException] = []

    def work() -> None:
        try:
            result.append(broadcast_one_to_all(tree))
        except BaseException as e:  # noqa: BLE001 - handed to the caller's thread
            error.append(e)

    thread = threading.Thread(target=work, name="xlaserve-broadcast", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise PeerTimeout(f"process {jax.process_index()}: broadcast across "
                          f"{jax.process_count()} processes did not finish within "
                          f"{timeout_s:g}s; a peer process died or hangs")
    if error:
        raise error[0]
    return result[0]
