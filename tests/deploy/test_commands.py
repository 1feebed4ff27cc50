"""What each rendered pod runs, checked against the code that will run it, with no server
started: the container's command line (the image's `xlaserve` entry point + args) parsed by the
real CLI (xlaserve.cli.main dispatching to `serve`'s or `worker`'s own parser, stopped right
after parsing); the config file it names read from the ConfigMap mounted there and loaded by
load_serve_config; every file and variable a flag or the config names is mounted or set; probes
on routes the HTTP app has (or the worker's gRPC port); the grace period above the drain; the
memory request above the engine's estimate (sharding/memory.py); and the multi-host pods'
environment resolved by DistributedConfig as the two-process jax.distributed code does."""

from __future__ import annotations

import argparse
import logging
import re
from pathlib import Path, PurePosixPath
from typing import Any

import pytest

from tests.deploy.manifests import KUSTOMIZE, Obj, find, kustomizations, name, pod_templates, render
from xlaserve import cli, compile_cache
from xlaserve.serving.config_file import load_serve_config
from xlaserve.serving.server_config import ServerConfig, replica_target

ENGINE_COMPONENTS = {"server", "worker", "prefill", "decode", "multihost"}
BASES = [d for d in kustomizations() if name(d).startswith("base/")]
ENTRYPOINT = ["xlaserve"]          # deploy/Containerfile's ENTRYPOINT (test_containerfile.py)
FETCH_MODEL = "/opt/xlaserve/bin/fetch-model.sh"   # where the Containerfile copies it


class Parsed(Exception):
    """Raised by the patched parser with what it parsed: the command stops there."""

    def __init__(self, prog: str, args: argparse.Namespace):
        super().__init__(prog)
        self.prog, self.namespace = prog, args


def parse_command_line(argv: list[str], monkeypatch: pytest.MonkeyPatch
                       ) -> tuple[str, argparse.Namespace]:
    """(parser prog, parsed namespace) of `xlaserve <argv>` as cli.main parses it; raises
    AssertionError with argparse's message for a command line the CLI refuses."""
    original = argparse.ArgumentParser.parse_args

    def parse_then_stop(self: argparse.ArgumentParser, args: Any = None,
                        namespace: Any = None) -> argparse.Namespace:
        raise Parsed(self.prog, original(self, args, namespace))

    with monkeypatch.context() as m:
        # cli.main sets the xlaserve logger to INFO for the server's start-up lines: undone
        m.setattr(logging.getLogger("xlaserve"), "level", logging.getLogger("xlaserve").level)
        m.setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)
        m.setattr(compile_cache, "enable_compilation_cache", lambda *a, **k: None)
        try:
            cli.main(argv)
        except Parsed as p:
            return p.prog, p.namespace
        except SystemExit as e:
            raise AssertionError(f"xlaserve {' '.join(argv)}: the CLI refuses it "
                                 f"(exit {e.code})") from None
    raise AssertionError(f"xlaserve {' '.join(argv)}: ran past its argument parser")


def engine_containers(objs: tuple[Obj, ...]) -> list[tuple[str, Obj, Obj]]:
    """(where, pod spec, the `xlaserve` container) of every pod template."""
    out = []
    for obj in objs:
        for where, template in pod_templates(obj):
            (c,) = [c for c in template["spec"]["containers"] if c["name"] == "xlaserve"]
            out.append((where, template, c))
    assert out
    return out


def mounted_file(objs: tuple[Obj, ...], pod: Obj, c: Obj, path: str) -> tuple[str, str | None]:
    """(volume kind, ConfigMap text or None) of the file at `path` in container `c`."""
    p = PurePosixPath(path)
    mounts = [m for m in c.get("volumeMounts", []) if p.is_relative_to(m["mountPath"])]
    assert mounts, f"{path}: under no volume mount of {c['name']}"
    (volume,) = [v for v in pod["spec"]["volumes"] if v["name"] == mounts[0]["name"]]
    key = str(p.relative_to(mounts[0]["mountPath"]))
    if "configMap" in volume:
        data = find(objs, "ConfigMap", volume["configMap"]["name"])["data"]
        assert key in data, f"{path}: ConfigMap {volume['configMap']['name']} has {list(data)}"
        return "configMap", data[key]
    if "secret" in volume:   # cert-manager's keys; the Secret is the operator's (README)
        assert key in ("ca.crt", "tls.crt", "tls.key"), f"{path}: key {key!r}"
        return "secret", None
    return next(k for k in volume if k != "name"), None


def load_mounted_config(objs: tuple[Obj, ...], pod: Obj, c: Obj, path: str,
                        tmp_path: Path) -> tuple[ServerConfig, Any]:
    kind, text = mounted_file(objs, pod, c, path)
    assert kind == "configMap" and text is not None, f"{path}: a {kind}, not the ConfigMap"
    local = tmp_path / PurePosixPath(path).name
    local.write_text(text)
    return load_serve_config(local)


def env_names(c: Obj) -> set[str]:
    return {e["name"] for e in c.get("env", [])}


@pytest.mark.parametrize("d", BASES, ids=name)
def test_each_container_runs_a_command_line_the_cli_accepts(
        d: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    objs = render(d)
    for where, pod, c in engine_containers(objs):
        assert "command" not in c, f"{where}: `command` would replace the xlaserve entry point"
        prog, args = parse_command_line(c["args"], monkeypatch)
        assert prog in ("xlaserve serve", "xlaserve worker"), (where, prog)
        config, _ = load_mounted_config(objs, pod, c, args.config, tmp_path)
        env = env_names(c)
        if prog == "xlaserve serve" and config.auth.secret_env:   # HTTP auth: the front's
            assert config.auth.secret_env in env, f"{where}: {config.auth.secret_env} unset"
        for f in (config.grpc.tls_ca, config.grpc.tls_cert, config.grpc.tls_key):
            if f:
                mounted_file(objs, pod, c, f)
        if config.grpc.token_env:
            assert config.grpc.token_env in env, f"{where}: {config.grpc.token_env} unset"
        if prog == "xlaserve worker":
            assert args.model in {m.name for m in config.models}, (where, args.model)
            for f in (args.tls_cert, args.tls_key, args.tls_client_ca):
                assert f, f"{where}: a worker beyond loopback needs TLS and client certs"
                mounted_file(objs, pod, c, f)
            assert args.token_env in env, f"{where}: --token-env {args.token_env} unset"
        for init in pod["spec"].get("initContainers", []):
            assert init["command"] == [FETCH_MODEL], (where, init["command"])
            model_dir = next(e["value"] for e in init["env"] if e["name"] == "MODEL_DIR")
            assert model_dir in {m.path for m in config.models}, (where, model_dir)


def _port(c: Obj, port: int | str) -> int:
    if isinstance(port, int):
        return port
    (p,) = [p["containerPort"] for p in c["ports"] if p["name"] == port]
    return int(p)


@pytest.fixture(scope="module")
def app_routes() -> set[str]:
    from xlaserve.serving.http.app import create_app
    from xlaserve.serving.http.state import ServingState
    from xlaserve.serving.router import Router

    app = create_app(ServingState(ServerConfig(), Router([])))
    return {r.rule for r in app.url_map.iter_rules() if "GET" in r.methods}


@pytest.mark.parametrize("d", BASES, ids=name)
def test_probes_point_at_what_the_server_serves(
        d: Path, app_routes: set[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    objs = render(d)
    for where, pod, c in engine_containers(objs):
        prog, args = parse_command_line(c["args"], monkeypatch)
        config, _ = load_mounted_config(objs, pod, c, args.config, tmp_path)
        probes = {k: c[k] for k in ("startupProbe", "readinessProbe", "livenessProbe") if k in c}
        if prog == "xlaserve serve" and "http" in {p["name"] for p in c["ports"]}:
            assert set(probes) == {"startupProbe", "readinessProbe", "livenessProbe"}, where
            assert probes["readinessProbe"]["httpGet"]["path"] == "/ready"
            assert probes["livenessProbe"]["httpGet"]["path"] == "/health"
            assert probes["startupProbe"]["httpGet"]["path"] == "/ready"   # covers warm-up
        for kind, probe in probes.items():
            if "httpGet" in probe:
                assert prog == "xlaserve serve", f"{where}: {kind} is HTTP on a gRPC worker"
                assert probe["httpGet"]["path"] in app_routes, (where, kind, probe)
                assert _port(c, probe["httpGet"]["port"]) == config.port, (where, kind)
            else:
                assert prog == "xlaserve worker" and "tcpSocket" in probe, (where, kind, probe)
                assert _port(c, probe["tcpSocket"]["port"]) == args.port, (where, kind)
        grace = pod["spec"]["terminationGracePeriodSeconds"]
        assert grace > config.drain_timeout_s, f"{where}: grace {grace} s <= drain"


_UNITS = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30}


def _bytes(quantity: str) -> int:
    m = re.fullmatch(r"(\d+)(Ki|Mi|Gi)?", quantity)
    assert m, f"memory quantity {quantity!r}"
    return int(m[1]) * _UNITS.get(m[2] or "", 1)


@pytest.mark.parametrize("d", BASES, ids=name)
def test_memory_requests_cover_the_engines_estimate(
        d: Path, model_dir: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from xlaserve.checkpoints.store import load_config
    from xlaserve.sharding.layout import ShardLayout
    from xlaserve.sharding.memory import device_bytes
    from xlaserve.sharding.mesh import MeshConfig

    objs = render(d)
    for where, pod, c in engine_containers(objs):
        if pod["metadata"]["labels"]["app.kubernetes.io/component"] not in ENGINE_COMPONENTS:
            continue
        _, args = parse_command_line(c["args"], monkeypatch)
        config, _ = load_mounted_config(objs, pod, c, args.config, tmp_path)
        (m,) = config.models
        mesh = MeshConfig.from_dict(m.engine_args.get("mesh", {}))
        est = device_bytes(ShardLayout.create(load_config(model_dir, "float32"), mesh),
                           int(m.engine_args["num_kv_blocks"]),
                           int(m.engine_args.get("block_size", 16)))
        request = _bytes(c["resources"]["requests"]["memory"])
        assert request >= est.total + (1 << 30), f"{where}: {request} B requested, engine {est}"
        assert _bytes(c["resources"]["limits"]["memory"]) >= request


def test_multihost_environment_is_what_the_distributed_code_reads(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from xlaserve.sharding.distributed import ENV_KEYS, ENV_PREFIX, DistributedConfig

    objs = render(KUSTOMIZE / "overlays" / "multihost-gpu")
    (lws,) = [o for o in objs if o["kind"] == "LeaderWorkerSet"]
    size = lws["spec"]["leaderWorkerTemplate"]["size"]
    ours = {ENV_PREFIX + v for v in ENV_KEYS.values()}
    for index, (where, pod, c) in enumerate(engine_containers((lws,))):
        # what LWS injects into every pod of group 0 (index: 0 leader, 1.. followers)
        lws_env = {"LWS_LEADER_ADDRESS": "xlaserve-0.xlaserve.xlaserve",
                   "LWS_GROUP_SIZE": str(size), "LWS_WORKER_INDEX": str(index)}
        env = {e["name"]: re.sub(r"\$\((\w+)\)", lambda v, lws=lws_env: lws[v[1]], e["value"])
               for e in c["env"] if "value" in e}
        assert {k for k in env if k.startswith(ENV_PREFIX)} <= ours, (where, sorted(env))
        _, args = parse_command_line(c["args"], monkeypatch)
        _, table = load_mounted_config(objs, pod, c, args.config, tmp_path)
        layout = DistributedConfig.resolve(table, env)
        assert layout is not None, where
        assert (layout.num_processes, layout.process_id) == (size, index), (where, layout)
        host, _, port = layout.coordinator_address.rpartition(":")
        assert host == lws_env["LWS_LEADER_ADDRESS"]
        leader_ports = {p["name"]: p["containerPort"] for p in
                        lws["spec"]["leaderWorkerTemplate"]["leaderTemplate"]["spec"]
                        ["containers"][0]["ports"]}
        assert int(port) == leader_ports["coordinator"], (where, port)


def test_front_end_replicas_name_the_worker_pods(monkeypatch: pytest.MonkeyPatch,
                                                  tmp_path: Path) -> None:
    for shape in ("front-workers", "disagg"):
        objs = render(KUSTOMIZE / "base" / shape)
        sets = {o["metadata"]["name"]: o for o in objs if o["kind"] == "StatefulSet"}
        pods = {f"{n}-{i}.{s['spec']['serviceName']}:50051" for n, s in sets.items()
                for i in range(s["spec"]["replicas"])}
        for where, pod, c in engine_containers(objs):
            if pod["metadata"]["labels"]["app.kubernetes.io/component"] == "front":
                _, args = parse_command_line(c["args"], monkeypatch)
                config, _ = load_mounted_config(objs, pod, c, args.config, tmp_path)
                (m,) = config.models
                assert {replica_target(r) for r in m.replicas} == pods, (shape, m.replicas)


def test_hpa_scales_on_a_metric_the_server_exports() -> None:
    import yaml

    from xlaserve.serving.metrics import Metrics

    exported = Metrics(list).render()
    text = exported.decode() if isinstance(exported, bytes) else exported
    (hpa,) = [o for o in render(KUSTOMIZE / "base" / "single")
              if o["kind"] == "HorizontalPodAutoscaler"]
    (metric,) = hpa["spec"]["metrics"]
    assert f"# TYPE {metric['pods']['metric']['name']} gauge" in text
    adapter = yaml.safe_load((KUSTOMIZE / "prometheus-adapter" / "values.yaml").read_text())
    assert any(metric["pods"]["metric"]["name"] in r["seriesQuery"]
               for r in adapter["rules"]["custom"])


@pytest.mark.parametrize("target", ["cpu", "cuda"])
def test_the_images_default_command_is_one_the_cli_accepts(
        target: str, monkeypatch: pytest.MonkeyPatch) -> None:
    import json

    from tests.deploy.test_containerfile import BY_NAME

    cmd = json.loads(BY_NAME[target].last("CMD") or "null")
    prog, args = parse_command_line(cmd, monkeypatch)
    assert (prog, args.config) == ("xlaserve serve", "/etc/xlaserve/config.toml")
    mount = {c["args"][2] for d in BASES for _, _, c in engine_containers(render(d))}
    assert mount == {args.config}, "every manifest mounts its config where the image looks"


def test_fetch_model_converts_with_flags_the_cli_accepts() -> None:
    script = (KUSTOMIZE.parents[0] / "image" / "fetch-model.sh").read_text()
    line = 'xlaserve convert gguf "$gguf" "$MODEL_DIR/.partial" --overwrite --quiet'
    assert line in script
    args = cli.build_parser().parse_args(["convert", "gguf", "m.gguf", "/models/m/.partial",
                                          "--overwrite", "--quiet", "--quantize", "int8"])
    assert (args.format, args.overwrite, args.quiet, args.quantize) == ("gguf", True, True,
                                                                        "int8")
