"""ReplicaDiscovery: a model group's replicas kept equal to what a name resolves to (a test
resolver standing in for DNS), joining only SERVING workers, draining vanished ones until their
requests finish; and grpc_health_check against a real grpc.health.v1 servicer on loopback."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer

from tests.serving.certs import CertAuthority
from tests.serving.fake_clock import Clock
from xlaserve.serving.admission import AdmissionController
from xlaserve.serving.engine_api import EngineStats
from xlaserve.serving.router import ModelGroup
from xlaserve.serving.router.discovery import ReplicaDiscovery, grpc_health_check
from xlaserve.serving.server_config import AdmissionConfig, ServedModel

NAME = "xlaserve-workers:50051"


@dataclass
class Worker:
    """Just enough of a remote engine for discovery and routing: started, stopped, ready."""

    address: str
    started: bool = False
    stopped: bool = False
    fail_start: bool = False

    @property
    def ready(self) -> bool:
        return self.started and not self.stopped

    async def start(self) -> None:
        if self.fail_start:
            raise ConnectionError(f"{self.address} refused")
        self.started = True

    async def stop(self) -> None:
        self.stopped = True

    def stats(self) -> EngineStats:
        return EngineStats()


class World:
    """What the name resolves to and which addresses are SERVING, set by the test."""

    def __init__(self) -> None:
        self.addresses: set[str] = set()
        self.serving: set[str] = set()
        self.engines: dict[str, Worker] = {}
        self.fail_resolve = False
        self.refuse_once: set[str] = set()   # addresses whose first engine fails to start

    async def resolve(self, host: str, port: int) -> set[str]:
        assert (host, port) == ("xlaserve-workers", 50051)
        if self.fail_resolve:
            raise OSError("Name or service not known")
        return set(self.addresses)

    async def health(self, address: str) -> bool:
        return address in self.serving

    def make_engine(self, address: str) -> Worker:
        self.engines[address] = Worker(address, fail_start=address in self.refuse_once)
        self.refuse_once.discard(address)
        return self.engines[address]

    def up(self, *ips: str) -> None:
        for ip in ips:
            self.addresses.add(f"{ip}:50051")
            self.serving.add(f"{ip}:50051")


def discovery(world: World, clock: Clock | None = None, drain_s: float = 30.0
              ) -> ReplicaDiscovery:
    group = ModelGroup(ServedModel("m"), [], AdmissionController(AdmissionConfig(), 4, 4))
    return ReplicaDiscovery(group, NAME, world.make_engine, world.health, world.resolve,
                            interval_s=0.01, drain_s=drain_s, clock=clock or Clock())


def names(d: ReplicaDiscovery) -> list[str]:
    return sorted(r.name.split("/", 1)[1] for r in d.group.replicas)


def test_replicas_follow_the_name_one_then_three_then_two() -> None:
    world = World()
    d = discovery(world)

    async def scenario() -> None:
        world.up("10.0.0.1")
        await d.refresh()
        assert names(d) == ["10.0.0.1:50051"]
        world.up("10.0.0.2", "10.0.0.3")
        await d.refresh()
        assert names(d) == ["10.0.0.1:50051", "10.0.0.2:50051", "10.0.0.3:50051"]
        assert all(world.engines[a].started for a in names(d))
        world.addresses.discard("10.0.0.2:50051")
        await d.refresh()
        assert names(d) == ["10.0.0.1:50051", "10.0.0.3:50051"]
        assert world.engines["10.0.0.2:50051"].stopped        # nothing ran there: stopped now
        assert not d.draining
        picked = {d.group.pick([1, 2, 3], "t").name for _ in range(8)}
        assert all("10.0.0.2" not in p for p in picked)

    asyncio.run(scenario())


def test_a_worker_joins_only_once_its_health_says_serving() -> None:
    world = World()
    d = discovery(world)

    async def scenario() -> None:
        world.up("10.0.0.1")
        world.addresses.add("10.0.0.9:50051")          # resolvable, still warming up
        await d.refresh()
        assert names(d) == ["10.0.0.1:50051"]
        assert "10.0.0.9:50051" not in world.engines    # no channel opened to it yet
        world.serving.add("10.0.0.9:50051")
        await d.refresh()
        assert names(d) == ["10.0.0.1:50051", "10.0.0.9:50051"]

    asyncio.run(scenario())


def test_a_vanished_worker_takes_no_new_requests_and_stops_after_its_running_ones() -> None:
    world, clock = World(), Clock()
    d = discovery(world, clock, drain_s=30.0)

    async def scenario() -> None:
        world.up("10.0.0.1", "10.0.0.2")
        await d.refresh()
        (leaving,) = [r for r in d.group.replicas if r.name.endswith("10.0.0.2:50051")]
        leaving.inflight = 2                              # two streams running there
        world.addresses.discard("10.0.0.2:50051")
        await d.refresh()
        assert leaving not in d.group.replicas            # no new request goes there
        assert not world.engines["10.0.0.2:50051"].stopped
        leaving.inflight = 1
        clock.t += 10
        await d.refresh()
        assert not world.engines["10.0.0.2:50051"].stopped
        leaving.inflight = 0                              # they finished
        await d.refresh()
        assert world.engines["10.0.0.2:50051"].stopped and not d.draining
        # a worker coming back under the same address joins again, with a new engine
        world.addresses.add("10.0.0.2:50051")
        await d.refresh()
        assert names(d) == ["10.0.0.1:50051", "10.0.0.2:50051"]
        assert world.engines["10.0.0.2:50051"].started

    asyncio.run(scenario())


def test_a_drain_that_outlasts_drain_s_is_cut() -> None:
    world, clock = World(), Clock()
    d = discovery(world, clock, drain_s=30.0)

    async def scenario() -> None:
        world.up("10.0.0.1", "10.0.0.2")
        await d.refresh()
        (leaving,) = [r for r in d.group.replicas if r.name.endswith("10.0.0.2:50051")]
        leaving.inflight = 1
        world.addresses.discard("10.0.0.2:50051")
        await d.refresh()
        clock.t += 29.9
        await d.refresh()
        assert not world.engines["10.0.0.2:50051"].stopped
        clock.t += 0.1
        await d.refresh()
        assert world.engines["10.0.0.2:50051"].stopped   # its stream fails over / errors

    asyncio.run(scenario())


def test_the_last_replica_stays_and_a_failed_lookup_changes_nothing() -> None:
    world = World()
    d = discovery(world)

    async def scenario() -> None:
        world.up("10.0.0.1")
        await d.refresh()
        world.addresses.clear()                           # a rolling update's gap
        await d.refresh()
        assert names(d) == ["10.0.0.1:50051"]
        world.fail_resolve = True
        world.up("10.0.0.2")
        await d.refresh()
        assert names(d) == ["10.0.0.1:50051"]
        world.fail_resolve = False
        world.addresses.discard("10.0.0.1:50051")
        await d.refresh()                                 # the replacement joins first
        assert names(d) == ["10.0.0.2:50051"]
        assert world.engines["10.0.0.1:50051"].stopped

    asyncio.run(scenario())


def test_a_worker_that_fails_to_start_is_retried_next_refresh() -> None:
    world = World()
    d = discovery(world)

    async def scenario() -> None:
        world.up("10.0.0.1")
        world.refuse_once.add("10.0.0.1:50051")          # SERVING, but the channel fails
        await d.refresh()
        assert names(d) == []
        assert world.engines["10.0.0.1:50051"].stopped   # the half-opened engine is closed
        await d.refresh()
        assert names(d) == ["10.0.0.1:50051"]

    asyncio.run(scenario())


def test_start_waits_for_a_replica_then_refreshes_in_the_background() -> None:
    world = World()

    async def scenario() -> None:
        d = discovery(world)
        with pytest.raises(ValueError, match="no SERVING replica at xlaserve-workers:50051"):
            await d.start(timeout_s=0)
        world.up("10.0.0.1")
        d = discovery(world)
        await d.start(timeout_s=5)
        assert names(d) == ["10.0.0.1:50051"]
        world.up("10.0.0.2")
        for _ in range(200):
            if len(d.group.replicas) == 2:
                break
            await asyncio.sleep(0.01)
        assert names(d) == ["10.0.0.1:50051", "10.0.0.2:50051"]
        await d.stop()

    asyncio.run(scenario())


@pytest.mark.parametrize("name", ["xlaserve-workers", "xlaserve-workers:grpc", ":50051"])
def test_a_name_without_host_and_port_is_refused(name: str) -> None:
    group = ModelGroup(ServedModel("m"), [], AdmissionController(AdmissionConfig(), 4, 4))
    world = World()
    with pytest.raises(ValueError, match="expected host:port"):
        ReplicaDiscovery(group, name, world.make_engine, world.health, world.resolve)


def test_grpc_health_check_reads_the_workers_health_service() -> None:
    async def scenario() -> None:
        server = grpc.aio.server()
        health = HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(health, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        check = grpc_health_check(None, timeout_s=2.0)
        target = f"127.0.0.1:{port}"
        try:
            await health.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
            assert await check(target) is False
            await health.set("", health_pb2.HealthCheckResponse.SERVING)
            assert await check(target) is True
        finally:
            await server.stop(0)
        assert await check(target) is False             # nothing listening

    asyncio.run(scenario())


def test_grpc_health_check_over_tls_checks_the_certificate_against_server_name(
        tmp_path: Path) -> None:
    ca = CertAuthority(tmp_path, "ca")
    server_files = ca.issue("worker", server=True)       # names 127.0.0.1 and localhost only
    credentials = grpc.ssl_channel_credentials(ca.cert.read_bytes())

    async def scenario() -> None:
        server = grpc.aio.server()
        health = HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(health, server)
        port = server.add_secure_port("127.0.0.2:0", grpc.ssl_server_credentials(
            [(server_files.key.read_bytes(), server_files.cert.read_bytes())]))
        await server.start()
        await health.set("", health_pb2.HealthCheckResponse.SERVING)
        target = f"127.0.0.2:{port}"                      # an IP its certificate does not name
        try:
            assert await grpc_health_check(credentials)(target) is False
            assert await grpc_health_check(credentials, server_name="localhost")(target) is True
        finally:
            await server.stop(0)

    asyncio.run(scenario())
