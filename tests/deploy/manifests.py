"""The Kustomize trees under deploy/kubernetes/ as the tests see them: every base and overlay
rendered by `kubectl kustomize` (the only renderer: without kubectl the tests skip and say so),
each object validated offline against the Kubernetes OpenAPI schemas by kubernetes-validate
(strict: unknown fields fail), and the custom kinds it has no schema for checked here field by
field, their pod templates validated as core PodTemplates.  A kind that is neither core nor
listed in CUSTOM_KINDS fails."""

from __future__ import annotations

import functools
import shutil
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
KUSTOMIZE = ROOT / "deploy" / "kubernetes"
KUBERNETES_VERSION = "1.32"      # the oldest release the manifests target
Obj = dict[str, Any]


def kustomizations() -> list[Path]:
    """Every base and overlay (a Component is only built inside an overlay)."""
    dirs = [p.parent for p in sorted(KUSTOMIZE.rglob("kustomization.yaml"))]
    return [d for d in dirs if yaml.safe_load((d / "kustomization.yaml").read_text())["kind"]
            == "Kustomization"]


def name(d: Path) -> str:
    return str(d.relative_to(KUSTOMIZE))


@functools.cache
def render(d: Path) -> tuple[Obj, ...]:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed: the manifests are rendered by `kubectl "
                    "kustomize` only")
    proc = subprocess.run([kubectl, "kustomize", str(d)], capture_output=True, text=True,
                          timeout=60, check=False)
    assert proc.returncode == 0, f"kubectl kustomize {name(d)}:\n{proc.stderr}"
    return tuple(o for o in yaml.safe_load_all(proc.stdout) if o)


def find(objs: tuple[Obj, ...], kind: str, obj_name: str) -> Obj:
    found = [o for o in objs if o["kind"] == kind and o["metadata"]["name"] == obj_name]
    assert len(found) == 1, f"{kind}/{obj_name}: {len(found)} in the render"
    return found[0]


def pod_templates(obj: Obj) -> Iterator[tuple[str, Obj]]:
    """(where, pod template) of a workload object."""
    if obj["kind"] in ("Deployment", "StatefulSet"):
        yield f"{obj['kind']}/{obj['metadata']['name']}", obj["spec"]["template"]
    elif obj["kind"] == "LeaderWorkerSet":
        lwt = obj["spec"]["leaderWorkerTemplate"]
        for role in ("leaderTemplate", "workerTemplate"):
            if role in lwt:
                yield f"LeaderWorkerSet/{obj['metadata']['name']}.{role}", lwt[role]


def validate_pod_template(template: Obj, where: str) -> None:
    validate_core({"apiVersion": "v1", "kind": "PodTemplate",
                   "metadata": {"name": where.replace("/", "-").replace(".", "-").lower()},
                   "template": template})


def validate_core(obj: Obj) -> None:
    try:
        kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
    except kubernetes_validate.ValidationError as e:
        raise AssertionError(f"{obj['kind']}/{obj['metadata'].get('name')}: "
                             f"{'.'.join(map(str, e.path))}: {e.message}") from None


def _only(fields: Obj, allowed: set[str], where: str) -> None:
    unknown = set(fields) - allowed
    assert not unknown, f"{where}: unknown fields {sorted(unknown)}; known {sorted(allowed)}"


def check_leaderworkerset(obj: Obj) -> None:
    """leaderworkerset.x-k8s.io/v1 (LWS v0.6): the fields these manifests use, their types."""
    where = f"LeaderWorkerSet/{obj['metadata']['name']}"
    _only(obj, {"apiVersion", "kind", "metadata", "spec"}, where)
    spec = obj["spec"]
    _only(spec, {"replicas", "leaderWorkerTemplate", "rolloutStrategy", "startupPolicy",
                 "networkConfig"}, f"{where}.spec")
    assert isinstance(spec.get("replicas", 1), int) and spec.get("replicas", 1) >= 0
    assert spec.get("startupPolicy", "LeaderCreated") in ("LeaderCreated", "LeaderReady")
    rollout = spec.get("rolloutStrategy", {})
    _only(rollout, {"type", "rollingUpdateConfiguration"}, f"{where}.spec.rolloutStrategy")
    assert rollout.get("type", "RollingUpdate") == "RollingUpdate"
    _only(rollout.get("rollingUpdateConfiguration", {}), {"maxUnavailable", "maxSurge"},
          f"{where}.spec.rolloutStrategy.rollingUpdateConfiguration")
    lwt = spec["leaderWorkerTemplate"]
    _only(lwt, {"size", "leaderTemplate", "workerTemplate", "restartPolicy",
                "subGroupPolicy"}, f"{where}.spec.leaderWorkerTemplate")
    assert isinstance(lwt["size"], int) and lwt["size"] >= 1, f"{where}: size {lwt['size']!r}"
    assert lwt.get("restartPolicy", "RecreateGroupOnPodRestart") in (
        "RecreateGroupOnPodRestart", "None"), f"{where}: restartPolicy {lwt['restartPolicy']!r}"
    assert "workerTemplate" in lwt, f"{where}: no workerTemplate"
    for role, template in pod_templates(obj):
        validate_pod_template(template, role)


def check_servicemonitor(obj: Obj) -> None:
    """monitoring.coreos.com/v1 ServiceMonitor (Prometheus Operator): selector + endpoints."""
    where = f"ServiceMonitor/{obj['metadata']['name']}"
    _only(obj, {"apiVersion", "kind", "metadata", "spec"}, where)
    spec = obj["spec"]
    _only(spec, {"selector", "endpoints", "namespaceSelector", "jobLabel"}, f"{where}.spec")
    _only(spec["selector"], {"matchLabels", "matchExpressions"}, f"{where}.spec.selector")
    assert all(isinstance(v, str) for v in spec["selector"].get("matchLabels", {}).values())
    assert spec["endpoints"], f"{where}: no endpoints"
    for ep in spec["endpoints"]:
        _only(ep, {"port", "path", "interval", "scheme", "scrapeTimeout"}, f"{where} endpoint")
        assert isinstance(ep["port"], str), f"{where}: endpoint port must name a Service port"


CUSTOM_KINDS: dict[tuple[str, str], Callable[[Obj], None]] = {
    ("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet"): check_leaderworkerset,
    ("monitoring.coreos.com/v1", "ServiceMonitor"): check_servicemonitor,
}


def validate(obj: Obj) -> None:
    """A core object against its schema; a custom kind by its checker; anything else fails."""
    try:
        validate_core(obj)
    except kubernetes_validate.SchemaNotFoundError:
        check = CUSTOM_KINDS.get((obj["apiVersion"], obj["kind"]))
        assert check is not None, (f"{obj['apiVersion']} {obj['kind']}/"
                                   f"{obj['metadata'].get('name')}: no Kubernetes schema and "
                                   f"not a custom kind the tests check {sorted(CUSTOM_KINDS)}")
        check(obj)
