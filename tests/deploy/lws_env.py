"""The environment deploy/kubernetes/base/multihost/leaderworkerset.yaml gives the xlaserve
container of one pod of a LeaderWorkerSet group, with LWS's injected variables filled in as
LWS fills them, read straight from the manifest file (no kubectl needed), so the two-process
jax.distributed test (tests/multidevice/test_multihost_serve.py) runs on the manifest's own
variables."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

LWS_MANIFEST = (Path(__file__).resolve().parents[2] / "deploy" / "kubernetes" / "base" /
                "multihost" / "leaderworkerset.yaml")


def lws_pod_env(index: int, size: int, leader_address: str,
                coordinator_port: int | None = None) -> dict[str, str]:
    """The plain-valued variables of pod `index` (0: the leader) of a group of `size`;
    `coordinator_port` replaces the manifest's coordinator port (a test picks a free one)."""
    lws = yaml.safe_load(LWS_MANIFEST.read_text())
    lwt = lws["spec"]["leaderWorkerTemplate"]
    template = lwt["leaderTemplate" if index == 0 else "workerTemplate"]
    (c,) = [c for c in template["spec"]["containers"] if c["name"] == "xlaserve"]
    injected = {"LWS_LEADER_ADDRESS": leader_address, "LWS_GROUP_SIZE": str(size),
                "LWS_WORKER_INDEX": str(index)}
    env = {e["name"]: re.sub(r"\$\((\w+)\)", lambda m: injected[m[1]], e["value"])
           for e in c.get("env", []) if "value" in e}
    if coordinator_port is not None:
        (leader,) = [c for c in lwt["leaderTemplate"]["spec"]["containers"]
                     if c["name"] == "xlaserve"]
        (port,) = [p["containerPort"] for p in leader["ports"] if p["name"] == "coordinator"]
        address = env["XLASERVE_COORDINATOR"]
        assert address == f"{leader_address}:{port}", address
        env["XLASERVE_COORDINATOR"] = f"{leader_address}:{coordinator_port}"
    return env
