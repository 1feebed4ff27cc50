"""Model groups and replica choice.

    "smollm2"          -> the default version of smollm2
    "smollm2@2"        -> that version
    "auto"             -> AutoRouteConfig: prompt tokens <= threshold_tokens ? small : large
    group.pick(prompt) -> a replica: the prefix-affinity choice (rendezvous hash of tenant +
                          the prompt's first `affinity_blocks` full KV blocks, so prompts that
                          share a prefix land where that prefix is cached), unless it has
                          `overload_slack` more requests in flight than the least loaded
                          replica, in which case the least loaded one.

Load is the router's own count of requests in flight per replica (exact, no polling) plus what
the replica says is waiting in its engine (covers other routers sharing a remote replica).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field

from xlaserve.serving.admission import AdmissionController
from xlaserve.serving.engine_api import AsyncEngine
from xlaserve.serving.server_config import AutoRouteConfig, RouterConfig, ServedModel
from xlaserve.serving.tokenizer import Tokenizer
from xlaserve.serving.types import Tier


class RoutingError(Exception):
    """404 (unknown model) or 403 (tier / token may not use it)."""

    def __init__(self, status: int, message: str, code: str):
        super().__init__(message)
        self.status = status
        self.code = code


@dataclass
class Replica:
    name: str
    engine: AsyncEngine
    inflight: int = 0
    routed: int = 0

    @property
    def load(self) -> int:
        try:
            waiting = self.engine.stats().num_waiting
        except Exception:  # noqa: BLE001 (no stats: count only our own in-flight requests)
            waiting = 0
        return self.inflight + max(0, waiting - self.inflight)


@dataclass
class ModelGroup:
    config: ServedModel
    replicas: list[Replica]
    admission: AdmissionController
    router_config: RouterConfig = field(default_factory=RouterConfig)

    @property
    def name(self) -> str:
        return self.config.name

    @property
    def id(self) -> str:
        return self.config.id

    @property
    def tokenizer(self) -> Tokenizer:
        return self.replicas[0].engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return min(r.engine.max_model_len for r in self.replicas)

    @property
    def ready(self) -> bool:
        return any(r.engine.ready for r in self.replicas)

    def affinity_key(self, prompt_ids: Sequence[int], tenant: str) -> bytes | None:
        bs, nb = self.router_config.block_size, self.router_config.affinity_blocks
        full = min(len(prompt_ids) // bs, nb) * bs
        if full == 0:
            return None  # no full block: nothing cacheable to be near
        return tenant.encode() + b"\0" + b",".join(str(t).encode() for t in prompt_ids[:full])

    def pick(self, prompt_ids: Sequence[int], tenant: str) -> Replica:
        live = [r for r in self.replicas if r.engine.ready] or self.replicas
        least = min(live, key=lambda r: (r.load, r.routed))
        key = self.affinity_key(prompt_ids, tenant)
        if key is None or len(live) == 1:
            return least
        preferred = max(live, key=lambda r: hashlib.blake2b(key + r.name.encode(),
                                                            digest_size=8).digest())
        if preferred.load - least.load >= self.router_config.overload_slack:
            return least
        return preferred


class Router:
    def __init__(self, groups: Sequence[ModelGroup], auto: AutoRouteConfig | None = None):
        self.groups = list(groups)
        self.auto = auto
        self._by_id = {g.id: g for g in self.groups}
        self._default = {g.name: g for g in self.groups if g.config.default}
        for g in self.groups:  # a name whose versions are all non-default: the first one
            self._default.setdefault(g.name, g)

    def model_ids(self) -> list[str]:
        ids = sorted(self._default) + sorted(self._by_id)
        return ids + (["auto"] if self.auto else [])

    def resolve(self, model: str, tier: Tier) -> ModelGroup:
        if model == "auto" and self.auto is not None:
            model = self.auto.small  # caller re-routes by prompt length (choose_auto)
        group = self._by_id.get(model) or self._default.get(model)
        if group is None:
            raise RoutingError(404, f"The model {model!r} does not exist; available: "
                                    f"{self.model_ids()}", "model_not_found")
        if not group.config.allows(tier):
            raise RoutingError(403, f"The model {model!r} is not available to the "
                                    f"{tier.name.lower()} tier", "model_not_allowed")
        return group

    def choose_auto(self, prompt_tokens: int, tier: Tier) -> ModelGroup:
        """The model "auto": small for short prompts, large for long ones.  A tier that may
        not use the large model gets the small one."""
        assert self.auto is not None
        if prompt_tokens > self.auto.threshold_tokens:
            large = self._default[self.auto.large]
            if large.config.allows(tier):
                return large
        return self.resolve(self.auto.small, tier)
