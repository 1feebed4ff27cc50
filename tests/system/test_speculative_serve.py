"""configs/smollm2-ngram.toml served by `xlaserve serve --config` (only its port and model
path filled in): streamed chunks carry several tokens where drafts were accepted, /metrics
counts the drafts, the per-request opt-out is taken, and a bad one is a 400 naming it."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.system.conftest import HttpServer, free_port

PRESET = Path(__file__).resolve().parents[2] / "configs" / "smollm2-ngram.toml"


@pytest.fixture(scope="module")
def ngram_server(model_dir: Path, tmp_path_factory: pytest.TempPathFactory
                 ) -> Iterator[HttpServer]:
    d = tmp_path_factory.mktemp("ngram")
    port = free_port()
    text = PRESET.read_text()
    text = re.sub(r"(?m)^port = 8000$", f"port = {port}", text)
    text = re.sub(r'(?m)^path = "[^"]*"', f'path = "{model_dir}"', text)
    cfg = d / "smollm2-ngram.toml"
    cfg.write_text(text)
    srv = HttpServer("ngram", cfg, port, d)
    try:
        yield srv.wait_ready()
    finally:
        code = srv.stop()
    assert code == 0, f"exited with {code} on SIGTERM:\n{srv.log_tail()}"


def test_preset_serves_several_tokens_per_chunk(ngram_server: HttpServer) -> None:
    code = PRESET.read_text()[:600]
    body = {"model": "smollm2", "prompt": code + "\n" + code[:150], "max_tokens": 48,
            "temperature": 0, "stream": True, "logprobs": 0, "ignore_eos": True}
    chunks = []
    with httpx.stream("POST", ngram_server.url + "/v1/completions", json=body,
                      timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    per_chunk = [len(c["choices"][0]["logprobs"]["tokens"]) for c in chunks
                 if c["choices"] and c["choices"][0]["logprobs"]]
    assert sum(per_chunk) == 48 and max(per_chunk) > 1, per_chunk
    text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    whole = httpx.post(ngram_server.url + "/v1/completions", timeout=120,
                       json={**body, "stream": False, "speculative": False}).json()
    assert whole["choices"][0]["text"] == text   # opted out: the same greedy text
    assert ngram_server.metric("xlaserve_spec_decode_num_accepted_tokens_total") > 0
    drafts = ngram_server.metric("xlaserve_spec_decode_num_drafts_total")
    assert ngram_server.metric("xlaserve_spec_decode_acceptance_length_count") == drafts > 0


def test_bad_opt_out_is_a_400_naming_it(ngram_server: HttpServer) -> None:
    r = httpx.post(ngram_server.url + "/v1/completions", timeout=30,
                   json={"model": "smollm2", "prompt": "hi", "speculative": "no"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "speculative", r.text
