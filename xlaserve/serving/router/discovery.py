"""Replicas found by name, not listed: a DNS name (a Kubernetes headless Service, one A record
per ready worker pod) resolved every `interval_s`, the model group's replica list kept equal to
what it resolves to.

    refresh():
      addresses = resolve(host, port)              {"10.0.0.5:50051", "10.0.0.6:50051", ...}
      appeared  = addresses - joined - draining:   engine = make_engine(address)
                    health(address) is SERVING  -> engine.start(); group.replicas += Replica
                    otherwise (still warming up)   tried again at the next refresh
      gone      = joined - addresses:              out of group.replicas at once (no new
                    request is routed to it), into `draining`; its engine is stopped once the
                    requests it runs have finished (Replica.inflight == 0) or `drain_s` passed
                    (those still running then fail over as for any replica that went down)

The group's replica list is mutated in place (the admission controller's cost view holds the
same list).  A group keeps at least one replica: the last one is drained only once another has
joined, so a name that resolves to nothing for a moment (a rolling update, a DNS hiccup)
leaves the group unready (its engine reports so), never without a tokenizer.  Static replica
lists (`grpc://host:port`) do not go through here.

TLS: the addresses are IPs, so whoever builds the engines and the health check dials each one
with the Service's name as the TLS server name (`grpc_health_check(server_name=...)`, and the
same `grpc.ssl_target_name_override` for the engine's channel); the workers' certificate names
the Service.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from xlaserve.serving.engine_api import AsyncEngine
from xlaserve.serving.router.router import ModelGroup, Replica

log = logging.getLogger(__name__)

Resolver = Callable[[str, int], Awaitable[set[str]]]      # (host, port) -> {"ip:port", ...}
HealthCheck = Callable[[str], Awaitable[bool]]            # "ip:port" -> SERVING?
EngineFactory = Callable[[str], AsyncEngine]              # "ip:port" -> an engine, not started


async def dns_resolver(host: str, port: int) -> set[str]:
    """Every address `host` resolves to now (A and AAAA records), as "ip:port"."""
    loop = asyncio.get_running_loop()
    try:
        infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        log.warning("discovery: %s does not resolve (%s): keeping the replicas it had",
                    host, e)
        raise
    return {f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"
            for ip in (info[4][0] for info in infos)}


def grpc_health_check(credentials: grpc.ChannelCredentials | None, timeout_s: float = 2.0,
                      server_name: str = "") -> HealthCheck:
    """A check asking the worker's grpc.health.v1 service (overall status, service "").

    A discovered worker is dialled by its IP address, which its certificate does not name:
    with TLS, `server_name` (the Service's DNS name, which the workers' certificate does name)
    is the name the certificate is checked against."""
    options = [("grpc.ssl_target_name_override", server_name)] if server_name else []

    async def check(target: str) -> bool:
        channel = (grpc.aio.secure_channel(target, credentials, options=options)
                   if credentials is not None else grpc.aio.insecure_channel(target))
        try:
            reply = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=timeout_s)
            return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)
        except grpc.aio.AioRpcError:
            return False
        finally:
            await channel.close()
    return check


async def _call(engine: AsyncEngine, method: str) -> None:
    """`engine.start()` / `.stop()` where it has them (a RemoteEngine does; a local one may not)."""
    call = getattr(engine, method, None)
    if call is not None:
        await call()


@dataclass
class Draining:
    replica: Replica
    since: float


class ReplicaDiscovery:
    """Keeps `group.replicas` equal to what `name` ("host:port") resolves to (see above)."""

    def __init__(self, group: ModelGroup, name: str, make_engine: EngineFactory,
                 health: HealthCheck, resolve: Resolver = dns_resolver,
                 interval_s: float = 5.0, drain_s: float = 30.0,
                 clock: Callable[[], float] = time.monotonic):
        host, sep, port = name.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ValueError(f"discovery name {name!r}: expected host:port (a headless "
                             f"Service's name and the workers' gRPC port)")
        if interval_s <= 0 or drain_s < 0:
            raise ValueError(f"discovery of {name!r}: interval_s={interval_s} must be > 0 "
                             f"and drain_s={drain_s} >= 0")
        self.group, self.name, self.host, self.port = group, name, host, int(port)
        self.make_engine, self.health, self.resolve = make_engine, health, resolve
        self.interval_s, self.drain_s, self.clock = interval_s, drain_s, clock
        self.joined: dict[str, Replica] = {}          # address -> replica in group.replicas
        self.draining: dict[str, Draining] = {}       # address -> replica taking no requests
        self._task: asyncio.Task[None] | None = None

    def _replica_name(self, address: str) -> str:
        return f"{self.group.id}/{address}"

    async def refresh(self) -> None:
        """One round: resolve, join the new SERVING addresses, drain the vanished ones."""
        try:
            addresses = await self.resolve(self.host, self.port)
        except OSError:
            addresses = set(self.joined)     # unresolvable now: change nothing
        for address in sorted(addresses - set(self.joined) - set(self.draining)):
            await self._join(address)
        for address in sorted(set(self.joined) - addresses):
            if len(self.group.replicas) > 1:
                self._drain(address)
        await self._finish_draining()

    async def _join(self, address: str) -> None:
        if not await self.health(address):
            log.info("discovery: %s found at %s, not SERVING yet", self.name, address)
            return
        engine = self.make_engine(address)
        try:
            await _call(engine, "start")
        except Exception as e:  # noqa: BLE001 - gone again or refused: next refresh retries
            log.warning("discovery: %s at %s did not start: %s", self.name, address, e)
            with contextlib.suppress(Exception):
                await _call(engine, "stop")
            return
        replica = Replica(self._replica_name(address), engine)
        self.joined[address] = replica
        self.group.replicas.append(replica)
        log.info("discovery: %s joined (%d replicas)", replica.name, len(self.group.replicas))

    def _drain(self, address: str) -> None:
        replica = self.joined.pop(address)
        self.group.replicas.remove(replica)
        self.draining[address] = Draining(replica, self.clock())
        log.info("discovery: %s left %s: draining %d running requests", replica.name,
                 self.name, replica.inflight)

    async def _finish_draining(self) -> None:
        now = self.clock()
        for address, d in list(self.draining.items()):
            if d.replica.inflight == 0 or now - d.since >= self.drain_s:
                del self.draining[address]
                await _call(d.replica.engine, "stop")
                log.info("discovery: %s stopped (%d requests still running)", d.replica.name,
                         d.replica.inflight)

    async def _run(self) -> None:
        while True:
            try:
                await self.refresh()
            except Exception:   # one bad round (a worker's odd answer) must not end discovery
                log.exception("discovery: refreshing %s failed", self.name)
            await asyncio.sleep(self.interval_s)

    async def start(self, timeout_s: float = 600.0) -> None:
        """Refresh until a replica has joined (a group needs one: its tokenizer, its
        max_model_len), up to `timeout_s` (ValueError after it), then once per interval in
        the background."""
        deadline = self.clock() + timeout_s
        await self.refresh()
        while not self.group.replicas:
            if self.clock() >= deadline:
                raise ValueError(f"discovery: no SERVING replica at {self.name} after "
                                 f"{timeout_s:g} s")
            await asyncio.sleep(min(self.interval_s, 1.0))
            await self.refresh()
        self._task = asyncio.ensure_future(self._run_after_sleep())

    async def _run_after_sleep(self) -> None:
        await asyncio.sleep(self.interval_s)
        await self._run()

    async def stop(self) -> None:
        """Stop refreshing; stop the engines still draining (the joined ones belong to the
        group, which stops its replicas' engines as it stops any)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        for d in self.draining.values():
            await _call(d.replica.engine, "stop")
        self.draining.clear()
