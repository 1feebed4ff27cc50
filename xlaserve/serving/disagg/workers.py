"""`spawn_workers = true`: `xlaserve serve` starts the model's prefill:// and decode:// workers
itself, as child processes on loopback (`xlaserve worker --role R --port P`, the same config
file), and stops them when it stops — for trying the split on one machine
(configs/smollm2-disagg.toml).  A child dies with the server even if the server is killed
(Linux: the parent-death signal).

The split's workers are single-process: a worker's KV export gathers a prompt's blocks from
its whole cache and its import writes them, which a process of a multi-process mesh (a
`[distributed]` job) cannot do with only its shard addressable.  `refuse_multiprocess`
refuses that layout by name when `xlaserve serve` or `xlaserve worker` starts, before any
process joins a job or loads a model."""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
from pathlib import Path
from types import TracebackType

from xlaserve.serving.server_config import ServerConfig, is_loopback, replica_target, target_host

PR_SET_PDEATHSIG = 1
LAYOUT_SOURCE = "[distributed] (or XLASERVE_COORDINATOR / _NUM_PROCESSES)"
STOP_TIMEOUT_S = 15.0


def _die_with_parent() -> None:   # runs in the child between fork and exec
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass   # not Linux: the server's own stop() still ends them


def refuse_multiprocess(config: ServerConfig, num_processes: int, where: str) -> None:
    """ValueError if `config` splits a model into prefill:// and decode:// workers while
    `num_processes` (the [distributed] layout `where` names) is more than one."""
    if num_processes <= 1:
        return
    split = [m.id for m in config.models
             if any(r.startswith(("prefill://", "decode://")) for r in m.replicas)]
    if split:
        raise ValueError(f"{where} makes a job of num_processes={num_processes}, but models "
                         f"{split} are split into prefill:// and decode:// workers, which run "
                         "single-process (a KV handoff reads and writes the whole cache); "
                         "serve the split without [distributed], or the model unsplit")


def refuse_multiprocess_worker(role: str, num_processes: int) -> None:
    """ValueError for `xlaserve worker --role R` on a layout of several processes."""
    if num_processes <= 1:
        return
    why = ("a KV handoff reads and writes the whole cache, which one process of a "
           "multi-process mesh does not hold" if role in ("prefill", "decode") else
           "a worker runs one process; a multi-process job is `xlaserve serve` on every host")
    raise ValueError(f"--role {role}: {LAYOUT_SOURCE} makes a job of "
                     f"num_processes={num_processes}, but {why}")


def worker_commands(config_path: str | Path, config: ServerConfig) -> list[list[str]]:
    """The `xlaserve worker` command line of every worker to spawn."""
    out = []
    for m in config.models:
        if not m.spawn_workers:
            continue
        for r in m.replicas:
            role = r.split("://", 1)[0]
            if role not in ("prefill", "decode"):
                continue
            target = replica_target(r)
            host, _, port = target.rpartition(":")
            if not is_loopback(target_host(target)):
                raise ValueError(f"models[{m.id}].spawn_workers: {r!r} is not on loopback; "
                                 "spawned workers run on this machine only")
            out.append([sys.executable, "-m", "xlaserve.cli", "worker", "--config",
                        str(config_path), "--model", m.id, "--host", host, "--port", port,
                        "--role", role])
    return out


class SpawnedWorkers:
    """The children of `worker_commands`, started on enter, stopped (SIGTERM, then SIGKILL
    after STOP_TIMEOUT_S) on exit."""

    def __init__(self, commands: list[list[str]]):
        self.commands = commands
        self.procs: list[subprocess.Popen[bytes]] = []

    def __enter__(self) -> SpawnedWorkers:
        for cmd in self.commands:
            print(f"xlaserve serve: starting worker: {' '.join(cmd[2:])}", file=sys.stderr,
                  flush=True)
            self.procs.append(subprocess.Popen(cmd, env=dict(os.environ),
                                               preexec_fn=_die_with_parent))
        return self

    def __exit__(self, kind: type[BaseException] | None, e: BaseException | None,
                 tb: TracebackType | None) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
