"""`xlaserve serve` on a mesh over two processes: HTTP on process 0, the same tokens as one
process; a peer killed under load makes process 0 answer with an error and exit 1, one killed
while process 0 is idle ends it through jax's heartbeat check; SIGTERM stops both cleanly.

    process 0: xlaserve serve --config C   (LWS_WORKER_INDEX=0)  HTTP :port, scheduler
    process 1: xlaserve serve --config C   (LWS_WORKER_INDEX=1)  follows process 0
    reference: xlaserve serve --config R   one process, one device  HTTP :port'

Each process gets the environment the multi-host manifest gives its pod
(deploy/kubernetes/base/multihost/leaderworkerset.yaml, read by tests/deploy/lws_env.py):
XLASERVE_COORDINATOR, XLASERVE_NUM_PROCESSES and XLASERVE_PROCESS_ID from LeaderWorkerSet's
variables, the coordinator port swapped for a free one; C's `[distributed]` table holds the
rest.  Each process has two CPU devices (gloo collectives over loopback), and the
model's `pipeline=2 x tensor=2` mesh spans all four: stage 0 on process 0's devices, stage 1
on process 1's.  The model is a tiny random Llama (tests/multidevice/scenarios.TINY: 8 heads,
4 layers) saved as a model folder: SmolLM2-135M's 9 heads forbid tensor=2, and its 30 layers
forbid pipeline=4, so it cannot fill a 4-device mesh (configs/smollm2-2hosts.toml runs it at
pipeline=2 over two hosts).  Prompts are token ids below TINY's vocabulary of 256 (the
tokenizer, borrowed from SmolLM2, decodes them).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import jax
import numpy as np
import pytest

from tests.deploy.lws_env import lws_pod_env
from xlaserve.serving.http.server import load_serve_config
from xlaserve.sharding.distributed import DistributedConfig

from .engine_workload import save_model_folder
from .scenarios import TINY, tiny_params
from .test_multihost import free_port

ROOT = Path(__file__).resolve().parents[2]
READY_LIMIT_S = 180      # start, load, compile (three processes on a shared CPU)
FAIL_LIMIT_S = 30        # a killed peer -> process 0 answered and exited
PROMPTS = [[5, 17, 42, 99, 3, 250, 7, 64, 128, 11], [200, 1, 2, 3]]
ENGINE_ARGS = ("max_model_len = 64, block_size = 16, num_kv_blocks = 32, max_num_seqs = 2, "
               "max_num_batched_tokens = 64, max_prefill_chunk = 32, "
               "min_step_tokens = 32, min_table_width = 4")


def server_toml(model: Path, port: int, mesh: str = "", distributed: str = "") -> str:
    mesh_arg = f", mesh = {mesh}" if mesh else ""
    return (f'[server]\nhost = "127.0.0.1"\nport = {port}\n\n[auth]\nmode = "none"\n\n'
            f'[[models]]\nname = "tiny"\npath = "{model}"\n'
            f"engine_args = {{ {ENGINE_ARGS}{mesh_arg} }}\n{distributed}")


class Servers:
    """Server processes with their logs in files; every one is killed at teardown."""

    def __init__(self, tmp: Path):
        self.tmp = tmp
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def start(self, name: str, config: Path, **env: str) -> subprocess.Popen[bytes]:
        base = {k: v for k, v in os.environ.items() if not k.startswith(("XLASERVE_", "JAX_"))}
        base.update(XLA_FLAGS="--xla_force_host_platform_device_count=2", JAX_PLATFORMS="cpu",
                    JAX_COMPILATION_CACHE_DIR=str(ROOT / ".jax_cache"),
                    JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0.1",
                    PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
                    PYTHONUNBUFFERED="1", **env)
        log = open(self.tmp / f"{name}.log", "wb")   # noqa: SIM115 - closed with the process
        proc = subprocess.Popen([sys.executable, "-m", "xlaserve.cli", "serve", "--config",
                                 str(config)], cwd=ROOT, env=base, stdout=log,
                                stderr=subprocess.STDOUT)
        log.close()
        self.procs[name] = proc
        return proc

    def log(self, name: str) -> str:
        return (self.tmp / f"{name}.log").read_text(errors="replace")

    def logs(self) -> str:
        return "\n".join(f"--- {n} ---\n{self.log(n)[-4000:]}" for n in self.procs)

    def wait_ready(self, ports: dict[str, int]) -> None:
        deadline = time.monotonic() + READY_LIMIT_S
        waiting = dict(ports)
        while waiting:
            for name, port in list(waiting.items()):
                try:
                    if httpx.get(f"http://127.0.0.1:{port}/ready", timeout=2).status_code == 200:
                        del waiting[name]
                except httpx.TransportError:
                    pass
            dead = {n: p.returncode for n, p in self.procs.items() if p.poll() is not None}
            assert not dead, f"exited early {dead}\n{self.logs()}"
            assert time.monotonic() < deadline, f"not ready in {READY_LIMIT_S}s: " \
                                                f"{sorted(waiting)}\n{self.logs()}"
            time.sleep(0.5)

    def kill_all(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=30)


@pytest.fixture
def servers(tmp_path: Path) -> Iterator[Servers]:
    s = Servers(tmp_path)
    try:
        yield s
    finally:
        s.kill_all()


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> Path:
    params = jax.tree_util.tree_map(np.asarray, tiny_params(TINY, seed=11))
    return save_model_folder(tmp_path_factory.mktemp("tiny") / "model", params, TINY,
                             tokenizer_from=model_dir)


def complete(port: int, timeout: float = 60) -> httpx.Response:
    return httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=timeout, json={
        "model": "tiny", "prompt": PROMPTS, "max_tokens": 8, "temperature": 0, "logprobs": 1})


def choices(response: httpx.Response) -> list[tuple[str, list[str], list[float]]]:
    assert response.status_code == 200, response.text
    out = sorted(response.json()["choices"], key=lambda c: c["index"])
    return [(c["text"], c["logprobs"]["tokens"], c["logprobs"]["token_logprobs"]) for c in out]


def start_pair(servers: Servers, tmp: Path, model: Path, **env: str) -> int:
    """Both processes of the two-process server, each with the environment the multi-host
    manifest gives its pod (tests/deploy/lws_env.py: XLASERVE_COORDINATOR, _NUM_PROCESSES,
    _PROCESS_ID from LWS's variables); returns process 0's HTTP port."""
    port, coordinator = free_port(), free_port()
    config = tmp / "two_processes.toml"
    config.write_text(server_toml(model, port, mesh="{ pipeline = 2, tensor = 2 }",
                                  distributed="\n[distributed]\nheartbeat_timeout_s = 10\n"))
    for index in (1, 0):
        pod_env = lws_pod_env(index, 2, "127.0.0.1", coordinator)
        servers.start(f"process{index}", config, **{**pod_env, **env})
    return port


def test_two_process_server_matches_one_process_then_fails_loudly(servers, tmp_path,
                                                                  tiny_model) -> None:
    start = time.monotonic()
    port = start_pair(servers, tmp_path, tiny_model)
    ref_port = free_port()
    ref_config = tmp_path / "one_process.toml"
    ref_config.write_text(server_toml(tiny_model, ref_port))
    servers.start("reference", ref_config)
    servers.wait_ready({"process0": port, "reference": ref_port})
    ready_s = time.monotonic() - start

    # Same greedy tokens (and log-probabilities, to float tolerance) as one process.
    got, want = choices(complete(port)), choices(complete(ref_port))
    assert [(t, toks) for t, toks, _ in got] == [(t, toks) for t, toks, _ in want]
    assert all(len(toks) == 8 for _, toks, _ in got), got
    np.testing.assert_allclose([lp for *_, lps in got for lp in lps],
                               [lp for *_, lps in want for lp in lps], atol=1e-4)
    assert "following process 0" in servers.log("process1")

    # Process 1 dies without a word: the next request is answered with an error, and
    # process 0 says why and exits non-zero.
    p0, p1 = servers.procs["process0"], servers.procs["process1"]
    p1.send_signal(signal.SIGKILL)
    p1.wait(timeout=10)
    killed = time.monotonic()
    pending = complete(port, timeout=FAIL_LIMIT_S)
    answered_s = time.monotonic() - killed
    assert pending.status_code == 500, pending.text
    error = pending.json()["error"]
    assert error["code"] == "engine_error" and "peer process died" in error["message"], error
    try:
        code = p0.wait(timeout=FAIL_LIMIT_S)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"process 0 still running {FAIL_LIMIT_S}s after its peer died\n"
                             f"{servers.logs()}") from None
    exited_s = time.monotonic() - killed
    log0 = servers.log("process0")
    assert code == 1, f"exit code {code}\n{log0[-4000:]}"
    assert "process 0: stopping the server: a step on the mesh over 2 processes failed" in log0
    with pytest.raises(httpx.TransportError):   # nobody listens any more
        httpx.get(f"http://127.0.0.1:{port}/ready", timeout=2)
    print(f"ready in {ready_s:.0f}s; {sum(len(t) for _, t, _ in got)} tokens identical to one "
          f"process; process 1 killed: error answered after {answered_s:.1f}s, process 0 "
          f"exited ({code}) after {exited_s:.1f}s: {error['message'][:140]}")


def test_stopping_process0_releases_process1(servers, tmp_path, tiny_model) -> None:
    """SIGTERM to process 0: it stops serving, releases the follower, and both exit 0."""
    port = start_pair(servers, tmp_path, tiny_model)
    servers.wait_ready({"process0": port})
    assert len(choices(complete(port))) == 2
    p0, p1 = servers.procs["process0"], servers.procs["process1"]
    stopped = time.monotonic()
    p0.send_signal(signal.SIGTERM)
    codes = [p.wait(timeout=FAIL_LIMIT_S) for p in (p0, p1)]
    assert codes == [0, 0], servers.logs()
    assert "process 0 closed the mesh after" in servers.log("process1")
    print(f"both exited 0 {time.monotonic() - stopped:.1f}s after SIGTERM; "
          f"{servers.log('process1').strip().splitlines()[-1]}")


def test_idle_process0_fails_when_its_peer_stops_beating(servers, tmp_path, tiny_model) -> None:
    """With nothing in flight no collective notices a dead peer; jax's coordination service
    does, after the heartbeat timeout (5 s here, set by the environment over the table's
    default), and ends process 0 non-zero with a line naming the silent task."""
    port = start_pair(servers, tmp_path, tiny_model, XLASERVE_HEARTBEAT_TIMEOUT_S="5")
    servers.wait_ready({"process0": port})
    assert len(choices(complete(port))) == 2
    p0, p1 = servers.procs["process0"], servers.procs["process1"]
    p1.send_signal(signal.SIGKILL)
    p1.wait(timeout=10)
    killed = time.monotonic()
    try:
        code = p0.wait(timeout=FAIL_LIMIT_S)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"idle process 0 still running {FAIL_LIMIT_S}s after its peer "
                             f"died\n{servers.logs()}") from None
    log0 = servers.log("process0")
    assert code != 0, log0[-4000:]
    assert "unhealthy (stopped sending heartbeats)" in log0, log0[-4000:]
    print(f"idle process 0 ended ({code}) {time.monotonic() - killed:.1f}s after process 1 "
          f"was killed")


def test_distributed_settings_from_table_and_environment() -> None:
    table = {"coordinator": "10.0.0.1:9876", "num_processes": 2}
    assert DistributedConfig.resolve(table, {"XLASERVE_PROCESS_ID": "1"}) == \
        DistributedConfig("10.0.0.1:9876", 2, 1)
    env = {"XLASERVE_COORDINATOR": "h:1", "XLASERVE_NUM_PROCESSES": "4",
           "XLASERVE_PROCESS_ID": "3", "XLASERVE_HEARTBEAT_TIMEOUT_S": "5"}
    assert DistributedConfig.resolve(None, env) == DistributedConfig("h:1", 4, 3, 5)
    assert DistributedConfig.resolve(table | {"process_id": 0}, env) == \
        DistributedConfig("h:1", 4, 3, 5)   # a set variable wins over the table
    assert DistributedConfig.resolve(None, {}) is None
    with pytest.raises(ValueError, match=r"needs \['process_id'\].*XLASERVE_PROCESS_ID"):
        DistributedConfig.resolve(table, {})
    with pytest.raises(ValueError, match="process_id=2 must be in"):
        DistributedConfig.resolve(table, {"XLASERVE_PROCESS_ID": "2"})
    with pytest.raises(ValueError, match="no coordinator"):
        DistributedConfig.resolve({"num_processes": 2}, {})
    with pytest.raises(ValueError, match="unknown"):
        DistributedConfig.resolve(table | {"process_id": 0, "port": 1}, {})


def test_two_host_preset_parses() -> None:
    config, table = load_serve_config(ROOT / "configs" / "smollm2-2hosts.toml")
    dist = DistributedConfig.resolve(table, {"XLASERVE_PROCESS_ID": "1"})
    assert dist is not None and (dist.num_processes, dist.process_id) == (2, 1)
    [model] = config.models
    assert model.engine_args["mesh"] == {"pipeline": 2, "tensor": 1}
