"""Every base and overlay under deploy/kubernetes/ renders with `kubectl kustomize`, and every
object it renders validates (tests/deploy/manifests.py); the references between objects hold
(ConfigMaps and Secrets pods mount or read, Services' selectors and ports, the ServiceMonitors'
Services, the HPA's target, the PDBs' pods); the validator itself rejects an unknown kind and
an unknown field."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

from tests.deploy.manifests import (
    KUSTOMIZE,
    Obj,
    find,
    kustomizations,
    name,
    pod_templates,
    render,
    validate,
)

DIRS = kustomizations()
SHAPES = ("single", "front-workers", "multihost", "disagg")
# Secrets the operator creates (README "Deploying"); everything else is in the render
EXTERNAL_SECRETS = {"xlaserve-jwt", "xlaserve-grpc-token", "xlaserve-grpc-tls"}


def test_every_shape_has_a_base_and_cpu_and_gpu_overlays() -> None:
    names = {name(d) for d in DIRS}
    for shape in SHAPES:
        assert {f"base/{shape}", f"overlays/{shape}-cpu", f"overlays/{shape}-gpu"} <= names


@pytest.mark.parametrize("d", DIRS, ids=name)
def test_renders_and_every_object_validates(d: Path) -> None:
    objs = render(d)
    assert objs, f"{name(d)} renders nothing"
    for obj in objs:
        validate(obj)


def _labels_match(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def _pods(objs: tuple[Obj, ...]) -> list[tuple[str, Obj]]:
    return [p for o in objs for p in pod_templates(o)]


@pytest.mark.parametrize("d", DIRS, ids=name)
def test_references_between_objects_hold(d: Path) -> None:
    objs = render(d)
    config_maps = {o["metadata"]["name"] for o in objs if o["kind"] == "ConfigMap"}
    pods = _pods(objs)
    assert pods, f"{name(d)}: no workload"
    for where, pod in pods:
        spec = pod["spec"]
        for v in spec.get("volumes", []):
            if "configMap" in v:
                assert v["configMap"]["name"] in config_maps, f"{where}: volume {v['name']}"
            if "secret" in v:
                assert v["secret"]["secretName"] in EXTERNAL_SECRETS, f"{where}: {v}"
        for c in spec.get("initContainers", []) + spec["containers"]:
            for e in c.get("env", []):
                ref = e.get("valueFrom", {}).get("secretKeyRef")
                assert ref is None or ref["name"] in EXTERNAL_SECRETS, f"{where}: {e}"
    for svc in (o for o in objs if o["kind"] == "Service"):
        sel = svc["spec"]["selector"]
        backing = [p for _, p in pods if _labels_match(sel, p["metadata"]["labels"])
                   or "leaderworkerset.sigs.k8s.io/worker-index" in sel
                   and _labels_match({k: v for k, v in sel.items() if "leaderworkerset" not in k},
                                     p["metadata"]["labels"])]
        assert backing, f"Service/{svc['metadata']['name']}: selects no pod template"
        ports = {p["name"] for pod in backing for c in pod["spec"]["containers"]
                 for p in c.get("ports", [])}
        for port in svc["spec"]["ports"]:
            assert port["targetPort"] in ports, f"Service/{svc['metadata']['name']}: {port}"
    for mon in (o for o in objs if o["kind"] == "ServiceMonitor"):
        sel = mon["spec"]["selector"]["matchLabels"]
        svcs = [s for s in objs if s["kind"] == "Service"
                and _labels_match(sel, s["metadata"].get("labels", {}))]
        assert svcs, f"ServiceMonitor/{mon['metadata']['name']}: selects no Service"
        for ep in mon["spec"]["endpoints"]:
            assert any(ep["port"] == p["name"] for s in svcs for p in s["spec"]["ports"])
    for pdb in (o for o in objs if o["kind"] == "PodDisruptionBudget"):
        sel = pdb["spec"]["selector"]["matchLabels"]
        assert any(_labels_match(sel, p["metadata"]["labels"]) for _, p in pods), pdb
    for hpa in (o for o in objs if o["kind"] == "HorizontalPodAutoscaler"):
        ref = hpa["spec"]["scaleTargetRef"]
        find(objs, ref["kind"], ref["name"])


@pytest.mark.parametrize("shape", SHAPES)
def test_gpu_overlay_gives_each_engine_pod_a_gpu_and_the_front_none(shape: str) -> None:
    objs = render(KUSTOMIZE / "overlays" / f"{shape}-gpu")
    for where, pod in _pods(objs):
        (c,) = [c for c in pod["spec"]["containers"] if c["name"] == "xlaserve"]
        assert c["image"].endswith(":cuda"), (where, c["image"])
        gpus = c["resources"].get("limits", {}).get("nvidia.com/gpu")
        front = pod["metadata"]["labels"]["app.kubernetes.io/component"] == "front"
        assert gpus == (None if front else 1), (where, gpus)


def test_workers_are_reached_only_from_the_front_end() -> None:
    objs = render(KUSTOMIZE / "base" / "front-workers")
    (policy,) = [o for o in objs if o["kind"] == "NetworkPolicy"]
    assert policy["spec"]["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == \
        "worker"
    (rule,) = policy["spec"]["ingress"]
    assert [f["podSelector"]["matchLabels"]["app.kubernetes.io/component"]
            for f in rule["from"]] == ["front"]
    assert [p["port"] for p in rule["ports"]] == [50051]


def _one(kind: str) -> Obj:
    for d in DIRS:
        for o in render(d):
            if o["kind"] == kind:
                return copy.deepcopy(o)
    raise AssertionError(f"no {kind} rendered")


def test_validator_rejects_an_unknown_kind() -> None:
    widget = yaml.safe_load("{apiVersion: example.com/v1, kind: Widget, metadata: {name: w}}")
    with pytest.raises(AssertionError, match="not a custom kind the tests check"):
        validate(widget)


@pytest.mark.parametrize("kind", ["Deployment", "LeaderWorkerSet", "ServiceMonitor"])
def test_validator_rejects_an_unknown_field(kind: str) -> None:
    obj = _one(kind)
    obj["spec"]["replicaz"] = 2
    with pytest.raises(AssertionError, match="replicaz"):
        validate(obj)


def test_validator_rejects_a_bad_pod_template_inside_a_leaderworkerset() -> None:
    lws = _one("LeaderWorkerSet")
    lws["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]["containers"][0]["port"] = 1
    with pytest.raises(AssertionError, match="port"):
        validate(lws)
