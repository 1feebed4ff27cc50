"""Real server processes on the real SmolLM2 model, on 127.0.0.1 with free ports.

`xlaserve serve` / `xlaserve worker` run as subprocesses of this test process, configured by the
templates in `configs/` (filled in with a port and the model folder), sharing the persistent
compilation cache `<repo>/.jax_cache` so that only the first start ever compiles.  Every process
is killed when its fixture ends.  `front` (configs/front.toml: JWT auth, limits, small admission
bounds) is started once per session: it is what the HTTP tests of several modules talk to, and
each test uses its own tenant so that no test sees another's limits or prefix cache.
"""

from __future__ import annotations

import os
import signal
import socket
import string
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import httpx
import jwt
import pytest
from prometheus_client.parser import text_string_to_metric_families

from xlaserve.serving.tokenizer import Tokenizer

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
CONFIGS = HERE / "configs"
MODEL = "smollm2"
JWT_SECRET = "server-tests-secret-0123456789abcdef"   # >= 32 bytes, as PyJWT asks of HS256
JWT_AUDIENCE = "xlaserve-tests"
START_TIMEOUT_S = 300.0   # a cold start compiles 14 buckets + the sampler on a busy 2-core CPU


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def write_config(template: str, out: Path, **values: Any) -> Path:
    text = string.Template((CONFIGS / template).read_text()).substitute(
        {k: str(v) for k, v in values.items()})
    out.write_text(text)
    return out


def wait_for(cond: Callable[[], bool], timeout: float, interval: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(interval)
    return cond()


class Proc:
    """`xlaserve <args>` in a subprocess, with `env` added to its environment; output goes to
    a log file shown on failure."""

    def __init__(self, name: str, args: list[str], log_dir: Path,
                 env: Mapping[str, str] | None = None):
        self.name = name
        self.log_path = log_dir / f"{name}.log"
        env = {**os.environ,
               "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
               "JAX_COMPILATION_CACHE_DIR": str(ROOT / ".jax_cache"),
               "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0.1",
               "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
               # CPU unless told otherwise: three JAX processes must not each grab most of
               # one accelerator's memory
               "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu"),
               "XLASERVE_TEST_JWT_SECRET": JWT_SECRET, **(env or {})}
        self._log = self.log_path.open("wb")
        self.popen = subprocess.Popen([sys.executable, "-m", "xlaserve.cli", *args], env=env,
                                      cwd=ROOT, stdout=self._log, stderr=subprocess.STDOUT)
        self.started = time.monotonic()

    @property
    def alive(self) -> bool:
        return self.popen.poll() is None

    def log_tail(self, chars: int = 4000) -> str:
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text(errors="replace")[-chars:]

    def fail(self, why: str) -> None:
        pytest.fail(f"{self.name}: {why} (exit code {self.popen.poll()}); log tail:\n"
                    f"{self.log_tail()}")

    def kill(self) -> None:
        """SIGKILL now (the replica-failure test)."""
        if self.alive:
            self.popen.kill()
        self.popen.wait(10)

    def stop(self) -> int:
        """SIGTERM, then SIGKILL if it has not exited within 10 s; returns the exit code."""
        if self.alive:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(10)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(10)
        self._log.close()
        return self.popen.returncode


class HttpServer(Proc):
    def __init__(self, name: str, config: Path, port: int, log_dir: Path,
                 env: Mapping[str, str] | None = None):
        super().__init__(name, ["serve", "--config", str(config)], log_dir, env)
        self.port = port
        self.url = f"http://127.0.0.1:{port}"

    def wait_ready(self, timeout: float = START_TIMEOUT_S) -> HttpServer:
        def ready() -> bool:
            if not self.alive:
                self.fail("exited before it was ready")
            try:
                return httpx.get(self.url + "/ready", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        if not wait_for(ready, timeout, 0.25):
            self.fail(f"not ready after {timeout:.0f} s")
        self.ready_after = time.monotonic() - self.started
        return self

    def metrics(self) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
        """Every sample of GET /metrics: (name, labels) -> value."""
        r = httpx.get(self.url + "/metrics", timeout=10)
        r.raise_for_status()
        return {(s.name, frozenset(s.labels.items())): s.value
                for fam in text_string_to_metric_families(r.text) for s in fam.samples}

    def metric(self, name: str, **labels: str) -> float:
        """Sum of the samples named `name` whose labels include `labels` (0 if none)."""
        want = set(labels.items())
        return sum(v for (n, lv), v in self.metrics().items() if n == name and want <= lv)

    def engine_idle(self) -> bool:
        """No KV block in use, nothing running or waiting, in the engine or in admission."""
        m = self.metrics()

        def total(name: str) -> float:
            return sum(v for (n, _), v in m.items() if n == name)

        return (total("xlaserve_kv_cache_usage_perc") == 0
                and total("xlaserve_num_requests_running") == 0
                and total("xlaserve_num_requests_waiting") == 0
                and total("xlaserve_admission_running") == 0
                and total("xlaserve_admission_waiting") == 0)


def make_token(tenant: str, tier: str = "internal", *, audience: str = JWT_AUDIENCE,
               secret: str = JWT_SECRET, expires_in: float = 3600, **claims: Any) -> str:
    now = int(time.time())
    return jwt.encode({"sub": tenant, "tier": tier, "aud": audience, "iat": now,
                       "exp": now + int(expires_in), **claims}, secret, algorithm="HS256")


def auth(tenant: str, tier: str = "internal") -> dict[str, str]:
    return {"Authorization": f"Bearer {make_token(tenant, tier)}"}


def assert_openai_error(r: httpx.Response, status: int | None = None,
                        code: str | None = None) -> dict[str, Any]:
    """The response is a 4xx (or `status`) with the OpenAI error shape; returns the error."""
    assert 400 <= r.status_code < 500, (r.status_code, r.text[:500])
    if status is not None:
        assert r.status_code == status, (r.status_code, r.text[:500])
    body = r.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"], err
    assert isinstance(err["type"], str) and err["type"], err
    if code is not None:
        assert err["code"] == code, err
    return err


@pytest.fixture(scope="session")
def tokenizer(model_dir: Path) -> Tokenizer:
    return Tokenizer.load(model_dir)


@pytest.fixture(scope="session")
def front(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[HttpServer]:
    """The JWT-authenticated single-engine server of configs/front.toml."""
    d = tmp_path_factory.mktemp("front")
    port = free_port()
    cfg = write_config("front.toml", d / "front.toml", port=port, model_dir=model_dir)
    srv = HttpServer("front", cfg, port, d)
    try:
        yield srv.wait_ready()
        assert srv.alive, srv.log_tail()
    finally:
        code = srv.stop()
    assert code == 0, f"front exited with {code} on SIGTERM:\n{srv.log_tail()}"
