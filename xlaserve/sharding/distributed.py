"""Several processes, one mesh: start jax's distributed runtime and broadcast with a deadline.

    process 0 (coordinator)                 process 1 .. n-1
    initialize(DistributedConfig)           initialize(DistributedConfig)   # same address
    jax.devices() = every process's devices; a mesh over them spans the processes
    broadcast_from_process0(x)   ──────>    broadcast_from_process0(zeros like x) -> x

Settings come from a `[distributed]` TOML table or the environment (XLASERVE_COORDINATOR,
XLASERVE_NUM_PROCESSES, XLASERVE_PROCESS_ID; jax's own JAX_COORDINATOR_ADDRESS, ... also work).

Failure: jax's coordination service checks every process's heartbeat; one that stops beating
for `heartbeat_timeout_s` fails the whole job (jax reports it and terminates the survivors).
Within a step, a collective whose peer died raises from the collective library, and
`broadcast_from_process0` gives up after `timeout_s` with PeerTimeout rather than waiting
forever on a peer that hangs.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import jax

ENV_PREFIX = "XLASERVE_"


class PeerTimeout(RuntimeError):
    """A collective across processes did not finish in time: a peer died or hangs."""


@dataclass(frozen=True)
class DistributedConfig:
    coordinator_address: str      # host:port where process 0 runs the coordination service
    num_processes: int
    process_id: int               # this process, in [0, num_processes)
    heartbeat_timeout_s: int = 10  # a silent process fails the job after this long
    initialization_timeout_s: int = 120
    cpu_collectives: str = "gloo"  # CPU devices' cross-process collectives (tests, CPU hosts)

    def __post_init__(self) -> None:
        if not isinstance(self.num_processes, int) or self.num_processes < 1:
            raise ValueError(f"num_processes must be an int >= 1, got {self.num_processes!r}")
        if not isinstance(self.process_id, int) or not 0 <= self.process_id < self.num_processes:
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
        known = set(cls.__dataclass_fields__)
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown [distributed] keys {sorted(unknown)}; known: "
                             f"{sorted(known)}")
        missing = {"coordinator_address", "num_processes", "process_id"} - set(d)
        if missing:
            raise ValueError(f"[distributed] needs {sorted(missing)}")
        return cls(**d)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> DistributedConfig | None:
        """From XLASERVE_COORDINATOR / _NUM_PROCESSES / _PROCESS_ID (or jax's JAX_* names);
        None when no coordinator is set (a single-process server)."""
        env = os.environ if env is None else env

        def get(ours: str, jax_name: str) -> str | None:
            return env.get(ENV_PREFIX + ours) or env.get(jax_name)

        address = get("COORDINATOR", "JAX_COORDINATOR_ADDRESS")
        if not address:
            return None
        num, pid = get("NUM_PROCESSES", "JAX_NUM_PROCESSES"), get("PROCESS_ID", "JAX_PROCESS_ID")
        if num is None or pid is None:
            raise ValueError(f"coordinator {address!r} is set but {ENV_PREFIX}NUM_PROCESSES "
                             f"and {ENV_PREFIX}PROCESS_ID are not both set")
        extra: dict[str, Any] = {}
        if env.get(ENV_PREFIX + "HEARTBEAT_TIMEOUT_S"):
            extra["heartbeat_timeout_s"] = int(env[ENV_PREFIX + "HEARTBEAT_TIMEOUT_S"])
        return cls(address, int(num), int(pid), **extra)


def initialize(config: DistributedConfig | None = None) -> bool:
    """Join the distributed runtime (before any other jax call).  `config` None reads the
    environment; returns False (and does nothing) when neither names a coordinator."""
    config = config or DistributedConfig.from_env()
    if config is None:
        return False
    jax.config.update("jax_cpu_collectives_implementation", config.cpu_collectives)
    jax.distributed.initialize(
        coordinator_address=config.coordinator_address, num_processes=config.num_processes,
        process_id=config.process_id, initialization_timeout=config.initialization_timeout_s,
        heartbeat_timeout_seconds=config.heartbeat_timeout_s)
    return True


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
