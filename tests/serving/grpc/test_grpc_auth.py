"""gRPC worker credentials (serving/grpc/auth.py): the bearer token on every Generation call
with the health service open, TLS with client certificates (mTLS), RemoteEngine dialling with
the [grpc] table's credentials behind the router, and a worker that authenticates nobody
refusing to listen beyond loopback (before it builds its engine)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.conftest import MODEL_DIR, ROOT
from tests.serving.certs import CertAuthority, CertFiles
from tests.serving.live_server import wait_for
from tests.serving.fake_engine import FakeEngine, expected_ids
from tests.serving.grpc.grpc_worker import Worker
from xlaserve.serving.grpc import xlaserve_pb2 as pb
from xlaserve.serving.grpc import xlaserve_pb2_grpc as pb_grpc
from xlaserve.serving.grpc.auth import DEFAULT_TOKEN_ENV, WorkerAuth, channel_credentials
from xlaserve.serving.grpc.worker import worker_main
from xlaserve.serving.http.server import build_model_engines
from xlaserve.serving.server_config import GrpcClientConfig, ServedModel, ServerConfig

TOKEN = "grpc-test-token-0123456789abcdef"
PROMPT = "one two three four"


@dataclass(frozen=True)
class Pki:
    ca: Path                 # signed the worker's and the front end's certificates
    worker: CertFiles
    front: CertFiles
    stranger: CertFiles      # a client certificate from another CA
    other_ca: Path


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    d = tmp_path_factory.mktemp("pki")
    ca, other = CertAuthority(d, "ca"), CertAuthority(d, "other-ca")
    return Pki(ca.cert, ca.issue("worker", server=True), ca.issue("front", server=False),
               other.issue("stranger", server=False), other.cert)


def mtls(pki: Pki, client: CertFiles | None = None, ca: Path | None = None
         ) -> GrpcClientConfig:
    """[grpc] trusting `ca` (default: the worker's CA), sending `client`'s certificate."""
    return GrpcClientConfig(tls_ca=str(ca or pki.ca), tls_cert=str(client.cert) if client else "",
                            tls_key=str(client.key) if client else "")


def open_channel(target: str, config: GrpcClientConfig | None) -> grpc.aio.Channel:
    """A channel to `target` as RemoteEngine opens it with `config` (None: plain)."""
    creds = channel_credentials(config, target) if config is not None else None
    return (grpc.aio.secure_channel(target, creds) if creds is not None
            else grpc.aio.insecure_channel(target))


async def generate(channel: grpc.aio.Channel) -> list[int]:
    stub = pb_grpc.GenerationStub(channel)
    msgs = [m async for m in stub.Generate(pb.GenerateRequest(
        prompt=PROMPT, sampling=pb.SamplingParams(max_tokens=5)), timeout=5)]
    return [t for m in msgs for t in m.token_ids]


async def code_of(call: Awaitable[object]) -> grpc.StatusCode:
    try:
        await call
    except grpc.aio.AioRpcError as e:
        return e.code()
    return grpc.StatusCode.OK


async def health(channel: grpc.aio.Channel) -> int:
    """The worker's health status, once its watcher has set it."""
    stub = health_pb2_grpc.HealthStub(channel)
    for _ in range(50):
        r = await stub.Check(health_pb2.HealthCheckRequest(service="xlaserve.v1.Generation"),
                             timeout=5)
        if r.status == health_pb2.HealthCheckResponse.SERVING:
            break
        await asyncio.sleep(0.05)
    return r.status


def run_against(worker: Worker, scenario: Callable[[str], Awaitable[None]]) -> None:
    with worker:
        asyncio.run(scenario(worker.target))


def test_token_guards_every_generation_call_and_health_stays_open(tokenizer, monkeypatch):
    eng = FakeEngine(tokenizer, "fake")
    expected = expected_ids(tokenizer.encode(PROMPT), 5)

    async def scenario(target: str) -> None:
        async with grpc.aio.insecure_channel(target) as ch:   # no token
            stub = pb_grpc.GenerationStub(ch)
            for call in (generate(ch), stub.ListModels(pb.ListModelsRequest(), timeout=5),
                         stub.GetStats(pb.GetStatsRequest(), timeout=5),
                         stub.Abort(pb.AbortRequest(request_id="x"), timeout=5)):
                assert await code_of(call) == grpc.StatusCode.UNAUTHENTICATED
            assert await health(ch) == health_pb2.HealthCheckResponse.SERVING
        monkeypatch.setenv(DEFAULT_TOKEN_ENV, "wrong-token-0123456789abcdef")
        async with open_channel(target, GrpcClientConfig()) as ch:
            assert await code_of(generate(ch)) == grpc.StatusCode.UNAUTHENTICATED
        monkeypatch.setenv(DEFAULT_TOKEN_ENV, TOKEN)
        async with open_channel(target, GrpcClientConfig()) as ch:   # local credentials
            assert await generate(ch) == expected

    run_against(Worker(eng, WorkerAuth(token=TOKEN)), scenario)
    assert [r.prompt_token_ids for r in eng.submitted] == [tokenizer.encode(PROMPT)]
    assert eng.abort_calls == []   # the unauthenticated Abort never reached the engine


def test_mtls_needs_a_certificate_from_the_ca_and_the_token(tokenizer, pki, monkeypatch):
    monkeypatch.setenv("WORKER_TOKEN", TOKEN)
    auth = WorkerAuth.load(str(pki.worker.cert), str(pki.worker.key), str(pki.ca),
                           token_env="WORKER_TOKEN")
    eng = FakeEngine(tokenizer, "fake")
    expected = expected_ids(tokenizer.encode(PROMPT), 5)

    async def fails(target: str, config: GrpcClientConfig | None) -> None:
        async with open_channel(target, config) as ch:
            assert await code_of(generate(ch)) == grpc.StatusCode.UNAVAILABLE

    async def scenario(target: str) -> None:
        monkeypatch.setenv(DEFAULT_TOKEN_ENV, TOKEN)
        async with open_channel(target, mtls(pki, pki.front)) as ch:
            assert await generate(ch) == expected
        await fails(target, mtls(pki, pki.stranger))             # another CA's certificate
        await fails(target, mtls(pki))                           # no client certificate
        await fails(target, mtls(pki, pki.front, pki.other_ca))  # the worker is not trusted
        await fails(target, None)                                # plaintext
        monkeypatch.delenv(DEFAULT_TOKEN_ENV)
        async with open_channel(target, mtls(pki, pki.front)) as ch:
            assert await code_of(generate(ch)) == grpc.StatusCode.UNAUTHENTICATED
            assert await health(ch) == health_pb2.HealthCheckResponse.SERVING

    run_against(Worker(eng, auth), scenario)
    assert len(eng.submitted) == 1


def test_remote_engine_with_credentials_behind_http(make_server, tokenizer, pki, monkeypatch):
    """The [grpc] table's credentials reach RemoteEngine through build_model_engines; a front end
    with the wrong token cannot start against the worker."""
    monkeypatch.setenv(DEFAULT_TOKEN_ENV, TOKEN)
    auth = WorkerAuth.load(str(pki.worker.cert), str(pki.worker.key), str(pki.ca))
    engine = FakeEngine(tokenizer, "fake", token_delay=0.01)
    with Worker(engine, auth) as w:
        cfg = ServerConfig(grpc=mtls(pki, pki.front), models=(ServedModel(
            "fake", path=str(MODEL_DIR), replicas=(f"grpc://{w.target}",)),))
        srv = make_server(cfg, asyncio.run(build_model_engines(cfg)))
        assert wait_for(lambda: httpx.get(srv.url + "/ready").status_code == 200)
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
        r = c.completions.create(model="fake", prompt=PROMPT, max_tokens=4)
        assert r.choices[0].text == tokenizer.decode(expected_ids(tokenizer.encode(PROMPT), 4))
        assert len(engine.submitted) == 1

        monkeypatch.setenv(DEFAULT_TOKEN_ENV, "wrong-token-0123456789abcdef")
        (remote,) = asyncio.run(build_model_engines(cfg))["fake@1"]

        async def start() -> None:
            try:
                await remote.start()
            finally:
                await remote.stop()

        with pytest.raises(grpc.aio.AioRpcError) as e:
            asyncio.run(start())
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_front_end_credential_errors(pki, monkeypatch):
    monkeypatch.delenv(DEFAULT_TOKEN_ENV, raising=False)
    assert channel_credentials(GrpcClientConfig(), "127.0.0.1:1") is None   # plain, loopback
    with pytest.raises(ValueError, match="'10.0.0.5' is not a loopback address and "
                                         "grpc.tls_ca is not set"):
        channel_credentials(GrpcClientConfig(), "10.0.0.5:50051")
    with pytest.raises(ValueError, match=r"grpc://10.0.0.5:50051: no token "
                                         r"\(\$XLASERVE_GRPC_TOKEN is not set\) and no client"):
        channel_credentials(mtls(pki), "10.0.0.5:50051")
    with pytest.raises(ValueError, match=r"variable \$FRONT_TOKEN is not set"):
        channel_credentials(GrpcClientConfig(token_env="FRONT_TOKEN"), "127.0.0.1:1")


def worker_config(tmp_path: Path) -> Path:
    """A worker config whose engine factory cannot be imported: an error about it would show
    that the engine was being built."""
    p = tmp_path / "worker.toml"
    p.write_text('[[models]]\nname = "m"\nengine = "no_such_module:build"\n')
    return p


def test_worker_without_credentials_refuses_a_public_bind(tmp_path):
    env = {**{k: v for k, v in os.environ.items() if k != DEFAULT_TOKEN_ENV},
           "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "-m", "xlaserve.cli", "worker", "--config",
                        str(worker_config(tmp_path)), "--model", "m", "--host", "0.0.0.0"],
                       env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert "--host '0.0.0.0' is not a loopback address" in r.stderr
    assert DEFAULT_TOKEN_ENV in r.stderr and "--tls-client-ca" in r.stderr
    assert "no_such_module" not in r.stderr


@pytest.mark.parametrize("flags,env,message", [
    ([], {DEFAULT_TOKEN_ENV: TOKEN}, "so that the token does not cross the network in the clear"),
    (["--token-env", "UNSET_TOKEN"], {}, "variable $UNSET_TOKEN is not set"),
    ([], {DEFAULT_TOKEN_ENV: "tiny-secret"}, "at least 16 printable ASCII characters"),
    (["--tls-cert", "w.pem"], {}, "--tls-cert and --tls-key must be given together"),
    (["--tls-client-ca", "ca.pem"], {}, "--tls-client-ca needs --tls-cert"),
])
def test_worker_credential_errors(tmp_path, monkeypatch, capsys, flags, env, message):
    monkeypatch.delenv(DEFAULT_TOKEN_ENV, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    code = worker_main(["--config", str(worker_config(tmp_path)), "--model", "m",
                        "--host", "10.1.2.3", *flags])
    err = capsys.readouterr().err
    assert code == 2 and message in err, err
    assert "no_such_module" not in err and "tiny-secret" not in err   # nor the token itself


def test_worker_certificate_errors_name_the_files(tmp_path, pki, capsys):
    cfg = str(worker_config(tmp_path))
    cert, wrong_key = str(pki.worker.cert), str(pki.front.key)
    assert worker_main(["--config", cfg, "--model", "m", "--tls-cert", cert,
                        "--tls-key", wrong_key]) == 2
    assert f"{cert!r} / {wrong_key!r}: not a PEM" in capsys.readouterr().err
    missing = str(tmp_path / "none.pem")
    assert worker_main(["--config", cfg, "--model", "m", "--tls-cert", str(pki.worker.cert),
                        "--tls-key", str(pki.worker.key), "--tls-client-ca", missing]) == 2
    assert f"--tls-client-ca {missing!r}: No such file" in capsys.readouterr().err
