"""Config files and validation, TLS, and engine failures (5xx for the engine's fault only,
and the server keeps serving)."""

from __future__ import annotations

import datetime
import json
import ssl
from pathlib import Path

import httpx
import pytest

from tests.serving.fake_engine import FakeEngine
from xlaserve.serving.config_file import config_from_dict, load_config
from xlaserve.serving.server_config import BUILTIN_ENGINE, ServedModel, ServerConfig
from xlaserve.serving.types import Tier

CONFIGS = Path(__file__).resolve().parents[3] / "configs"


def test_presets_load():
    c = load_config(CONFIGS / "smollm2.toml")
    assert (c.host, c.port, c.auth.mode) == ("127.0.0.1", 8000, "none")
    assert c.models[0].id == "smollm2@135m-instruct"
    assert c.models[0].engine_args["max_model_len"] == 2048
    ngram = load_config(CONFIGS / "smollm2-ngram.toml").models[0]
    from xlaserve.serving.engine.config import EngineConfig
    from xlaserve.serving.speculative import SpeculativeConfig

    assert EngineConfig.from_args(ngram.engine_args).speculative == SpeculativeConfig(
        "ngram", num_speculative_tokens=4, prompt_lookup_max=4, prompt_lookup_min=2)
    g = load_config(CONFIGS / "gateway-example.toml")
    assert g.auth.mode == "rs256" and g.auto is not None and g.auto.threshold_tokens == 512
    assert g.tier_limits(Tier.FREE).requests_per_minute == 20
    assert g.models[1].allows(Tier.PAID) and not g.models[1].allows(Tier.FREE)
    assert g.grpc.tls_ca and g.grpc.tls_cert and g.grpc.token_env == ""  # $XLASERVE_GRPC_TOKEN
    q = load_config(CONFIGS / "smollm2-int8.toml")
    assert q.models[0].quantization == "int8" and c.models[0].quantization is None
    assert q.models[0].path == c.models[0].path   # the float folder, quantized as it loads


@pytest.mark.parametrize("data,match", [
    ({"server": {"prot": 1}}, r"unknown key\(s\) \['prot'\]"),
    ({"bogus": {}}, "unknown section"),
    ({"auth": {"mode": "basic"}}, "auth.mode='basic'"),
    ({"auth": {"mode": "hs256"}}, "needs auth.secret"),
    ({"models": [{"name": "a"}, {"name": "a"}]}, "duplicate"),
    ({"models": [{"name": "a", "replicas": ["http://x"]}]}, "not 'local'"),
    ({"models": [{"name": "a", "tiers": ["gold"]}]}, "tier='gold'"),
    ({"models": [{"name": "a", "quantization": "int4"}]}, r"models\[a\].quantization='int4'"),
    ({"limits": {"free": {"requests_per_minute": -1}}}, "must be >= 0"),
    ({"admission": {"slo_wait_s": {"free": 0}}}, "must be > 0"),
    ({"auto": {"small": "a", "large": "b"}, "models": [{"name": "a"}]}, "'b' is not in"),
    ({"server": {"tls_cert": "c.pem"}}, "together"),
    ({"server": {"host": "10.1.2.3"}}, "refusing to serve without authentication"),
    ({"grpc": {"tls_cert": "c.pem"}}, "grpc.tls_cert and grpc.tls_key must be given together"),
    ({"grpc": {"tls_cert": "c.pem", "tls_key": "k.pem"}}, "'c.pem' needs grpc.tls_ca"),
    ({"grpc": {"token_env": "s3cr3t token"}}, "grpc.token_env: not an environment variable"),
    ({"grpc": {"tls": True}}, r"\[grpc\]: unknown key\(s\) \['tls'\]"),
    ({"models": [{"name": "a", "replicas": ["grpc://10.0.0.5:50051"]}]},
     "grpc://10.0.0.5:50051: '10.0.0.5' is not a loopback address and grpc.tls_ca is not set"),
])
def test_config_validation(data, match):
    with pytest.raises(ValueError, match=match):
        config_from_dict(data)


@pytest.mark.parametrize("data,match", [
    # a string is truthy: "false" would switch prompt logging on
    ({"audit": {"path": "a.jsonl", "include_prompts": "false"}},
     r"^\[audit\]\.include_prompts='false': expected true or false$"),
    ({"models": [{"name": "m", "default": "false"}]},
     r"^\[\[models\]\] #0\.default='false': expected true or false$"),
    ({"models": [{"name": "m", "replicas": "local"}]},
     r"^\[\[models\]\] #0\.replicas='local': expected an array$"),
    ({"models": [{"name": "m", "tiers": "paid"}]},
     r"^\[\[models\]\] #0\.tiers='paid': expected an array$"),
    ({"models": [{"name": "m", "tiers": ["paid", 1]}]},
     r"^\[\[models\]\] #0\.tiers\[1\]=1: expected a string$"),
    ({"models": [{"name": "m", "max_inflight": 2.5}]},
     r"^\[\[models\]\] #0\.max_inflight=2\.5: expected an integer$"),
    ({"models": [{"name": "m", "max_queue": True}]},
     r"^\[\[models\]\] #0\.max_queue=True: expected an integer$"),
    ({"models": [{"name": "m", "engine_args": "tp2"}]},
     r"^\[\[models\]\] #0\.engine_args='tp2': expected a table$"),
    ({"router": {"block_size": "16"}}, r"^\[router\]\.block_size='16': expected an integer$"),
    ({"server": {"port": "8000"}}, r"^\[server\]\.port='8000': expected an integer$"),
    ({"server": {"drain_timeout_s": "30"}},
     r"^\[server\]\.drain_timeout_s='30': expected a number$"),
    ({"admission": {"slo_wait_s": {"free": "2"}}},
     r"^\[admission\]\.slo_wait_s\.free='2': expected a number$"),
    ({"limits": {"free": {"tokens_per_day": 1.5}}},
     r"^\[limits\.free\]\.tokens_per_day=1\.5: expected an integer$"),
    ({"grpc": {"tls_ca": 1}}, r"^\[grpc\]\.tls_ca=1: expected a string$"),
    ({"server": []}, r"^\[server\]: expected a table, got list$"),
    ({"models": {"name": "m"}}, r"^\[models\]: expected an array, got dict$"),
])
def test_config_types(data, match):
    with pytest.raises(ValueError, match=match):
        config_from_dict(data)


def test_config_number_types_accepted():
    c = config_from_dict({"server": {"drain_timeout_s": 5},
                          "limits": {"free": {"requests_per_minute": 3}},
                          "audit": {"include_prompts": True},
                          "models": [{"name": "m", "replicas": ["local", "local"],
                                      "tiers": ["paid"]}]})
    assert c.drain_timeout_s == 5.0 and isinstance(c.drain_timeout_s, float)
    assert c.tier_limits(Tier.FREE).requests_per_minute == 3.0
    assert c.audit.include_prompts is True
    assert c.models[0].replicas == ("local", "local") and c.models[0].tiers == ("paid",)


def test_serve_reports_a_config_type_error(tmp_path, capsys):
    from xlaserve.serving.http.server import serve_main

    p = tmp_path / "c.toml"
    p.write_text('[server]\nport = "8000"\n[[models]]\nname = "m"\nengine = "x:y"\n')
    assert serve_main(["--config", str(p)]) == 2
    err = capsys.readouterr().err
    assert err.strip() == f"xlaserve serve: error: {p}: [server].port='8000': expected an integer"


def test_json_config(tmp_path):
    p = tmp_path / "c.json"
    p.write_text(json.dumps({"server": {"port": 9000}, "models": [{"name": "m"}]}))
    assert load_config(p).port == 9000


def _self_signed(tmp_path: Path) -> tuple[str, str]:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.UTC)
    import ipaddress
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=1))
            .not_valid_after(now + datetime.timedelta(hours=1))
            .add_extension(x509.SubjectAlternativeName(
                [x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
            .sign(key, hashes.SHA256()))
    c, k = tmp_path / "cert.pem", tmp_path / "key.pem"
    c.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    k.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                    serialization.PrivateFormat.PKCS8,
                                    serialization.NoEncryption()))
    return str(c), str(k)


def test_tls(make_server, tmp_path):
    cert, key = _self_signed(tmp_path)
    cfg = ServerConfig(models=(ServedModel("fake"),), tls_cert=cert, tls_key=key)
    srv = make_server(cfg)
    assert srv.url.startswith("https://")
    r = httpx.post(srv.url + "/v1/completions",
                   json={"model": "fake", "prompt": "hi there", "max_tokens": 2},
                   verify=ssl.create_default_context(cafile=cert))
    assert r.status_code == 200
    with pytest.raises(httpx.HTTPError):  # plain HTTP is not served
        httpx.get(srv.url.replace("https://", "http://") + "/health", timeout=2)


def test_engine_failure_is_5xx_and_server_keeps_serving(make_server, tokenizer):
    prompt = tokenizer.encode("one two three")
    eng = FakeEngine(tokenizer, "fake", fail_token=prompt[-2])  # fails at the 2nd token
    srv = make_server(ServerConfig(models=(ServedModel("fake"),)), {"fake@1": [eng]})
    body = {"model": "fake", "prompt": "one two three", "max_tokens": 5}
    r = httpx.post(srv.url + "/v1/completions", json=body)
    assert r.status_code == 500 and r.json()["error"]["code"] == "engine_error"
    r = httpx.post(srv.url + "/v1/completions", json={**body, "stream": True})
    lines = [x for x in r.text.splitlines() if x.startswith("data: ")]
    assert '"engine_error"' in lines[-2] and lines[-1] == "data: [DONE]"
    ok = httpx.post(srv.url + "/v1/completions", json={**body, "prompt": "four five six"})
    assert ok.status_code == 200
    assert eng.blocks_in_use == 0


def test_engine_exception_fails_only_that_request(make_server, tokenizer):
    from xlaserve.serving.engine_api import AsyncEngine
    from xlaserve.serving.grpc.client import RemoteEngine

    class Exploding(FakeEngine):
        def submit(self, request):  # type: ignore[override]
            if "boom" in self.tokenizer.decode(request.prompt_token_ids):
                raise RuntimeError("device step failed")
            return super().submit(request)

    eng = Exploding(tokenizer, "fake")
    assert isinstance(eng, AsyncEngine)
    assert isinstance(RemoteEngine("127.0.0.1:1", "fake", tokenizer), AsyncEngine)
    srv = make_server(ServerConfig(models=(ServedModel("fake"),)), {"fake@1": [eng]})
    r = httpx.post(srv.url + "/v1/completions", json={"model": "fake", "prompt": "boom now"})
    assert r.status_code == 500 and "device step failed" in r.json()["error"]["message"]
    ok = httpx.post(srv.url + "/v1/completions", json={"model": "fake", "prompt": "fine now"})
    assert ok.status_code == 200
    adm = srv.state.router.groups[0].admission
    assert adm.running == 0 and srv.state.router.groups[0].replicas[0].inflight == 0
    m = httpx.get(srv.url + "/metrics").text
    assert 'xlaserve_request_success_total{finished_reason="error",model_name="fake@1"} 1.0' in m
    assert 'xlaserve_time_to_first_token_seconds_count{model_name="fake@1"} 1.0' in m


def test_serve_reports_a_distributed_type_error(tmp_path, capsys):
    from xlaserve.serving.http.server import serve_main

    p = tmp_path / "c.toml"
    p.write_text('[[models]]\nname = "m"\nengine = "x:y"\n[distributed]\ncoordinator = 9876\n'
                 'num_processes = 2\nprocess_id = 0\n')
    assert serve_main(["--config", str(p)]) == 2
    err = capsys.readouterr().err
    assert err.strip() == ("xlaserve serve: error: [distributed] coordinator_address=9876: "
                           "expected str, got int")


def test_engine_args_keys_checked_at_load():
    unknown = (r"^models\[m\]\.engine_args: unknown key\(s\) \['max_seqs'\]; "
               r"known: \[.*'max_num_seqs'")
    for engine in ({}, {"engine": BUILTIN_ENGINE}):   # the built-in factory, by default or named
        with pytest.raises(ValueError, match=unknown):
            config_from_dict({"models": [{"name": "m", **engine,
                                          "engine_args": {"max_seqs": 4}}]})
    ok = config_from_dict({"models": [{"name": "m", "replicas": ["local"], "engine_args": {
        "max_num_seqs": 4, "mesh": {"tensor": 1}}}]})
    assert ok.models[0].engine_args["max_num_seqs"] == 4
    assert ok.models[0].engine == BUILTIN_ENGINE   # a local replica needs no `engine` line
    # another engine factory's arguments are its own business
    other = config_from_dict({"models": [{"name": "m", "engine": "tests.x:y",
                                          "engine_args": {"anything": 1}}]})
    assert other.models[0].engine_args == {"anything": 1}
