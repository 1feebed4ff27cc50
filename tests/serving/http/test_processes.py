"""`serve_main` and `worker_main` as real processes: a worker serving a fake engine over gRPC,
and a front end whose config routes the model to it, driven by the openai client, then shut
down by SIGTERM while a stream runs (it ends with an explicit error event)."""

from __future__ import annotations

from tests.conftest import MODEL_DIR

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
from tests.serving.live_server import free_port
from tests.serving.fake_engine import expected_ids

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]


def spawn(fn: str, args: list[str]) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(HERE)])}
    code = f"import sys; from {fn.rsplit('.', 1)[0]} import {fn.rsplit('.', 1)[1]} as f; " \
           "sys.exit(f(sys.argv[1:]))"
    return subprocess.Popen([sys.executable, "-c", code, *args], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def test_worker_and_server_processes(tmp_path, tokenizer):
    model_dir = str(MODEL_DIR)
    wport, hport = free_port(), free_port()
    (tmp_path / "worker.toml").write_text(f"""
[[models]]
name = "fake"
path = "{model_dir}"
engine = "tests.serving.fake_engine:build"
engine_args = {{ token_delay = 0.01 }}
""")
    (tmp_path / "serve.toml").write_text(f"""
[server]
port = {hport}
drain_timeout_s = 0.5
[[models]]
name = "fake"
path = "{model_dir}"
replicas = ["grpc://127.0.0.1:{wport}"]
""")
    worker = spawn("xlaserve.serving.grpc.worker.worker_main",
                   ["--config", str(tmp_path / "worker.toml"), "--model", "fake",
                    "--port", str(wport)])
    server = None
    try:
        time.sleep(0.5)
        server = spawn("xlaserve.serving.http.server.serve_main",
                       ["--config", str(tmp_path / "serve.toml")])
        url = f"http://127.0.0.1:{hport}"
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                if httpx.get(url + "/ready", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert server.poll() is None and worker.poll() is None
            time.sleep(0.1)
        c = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        r = c.completions.create(model="fake", prompt="over the wire", max_tokens=3, n=2)
        want = tokenizer.decode(expected_ids(tokenizer.encode("over the wire"), 3))
        assert [ch.text for ch in r.choices] == [want, want]
        texts = {0: "", 1: ""}
        for ch in c.completions.create(model="fake", prompt="over the wire", max_tokens=3,
                                       n=2, stream=True):
            for choice in ch.choices:
                texts[choice.index] += choice.text
        assert texts == {0: want, 1: want}
        bad = httpx.post(url + "/v1/completions", json={"model": "fake"},
                         headers={"x-request-id": "bad-1"})
        assert bad.status_code == 400 and bad.headers["x-request-id"] == "bad-1"
        # SIGTERM while a ~4 s stream runs: after the 0.5 s drain the stream ends with an
        # explicit error event (not a cut connection) and the server exits 0.
        events: list[str] = []
        with httpx.stream("POST", url + "/v1/completions", timeout=30, json={
                "model": "fake", "prompt": "over the wire", "max_tokens": 400,
                "stream": True}) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    if len(events) == 2:
                        server.send_signal(signal.SIGTERM)
        assert events[-1] == "[DONE]" and len(events) < 400, events[-3:]
        assert json.loads(events[-2])["error"]["code"] == "server_shutting_down"
        assert server.wait(15) == 0
    finally:
        for p in (server, worker):
            if p is not None and p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in (server, worker):
            if p is not None:
                try:
                    assert p.wait(15) == 0, p.stdout.read().decode()[-2000:] if p.stdout else ""
                except subprocess.TimeoutExpired:
                    p.kill()
                    raise


def test_serve_refuses_public_bind_without_auth(tmp_path):
    (tmp_path / "c.toml").write_text('[server]\nhost = "0.0.0.0"\n[[models]]\nname = "m"\n')
    p = spawn("xlaserve.serving.http.server.serve_main", ["--config", str(tmp_path / "c.toml")])
    out = p.communicate(timeout=30)[0].decode()
    assert p.returncode == 2 and "refusing to serve without authentication" in out
