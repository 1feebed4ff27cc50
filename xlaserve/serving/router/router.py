"""Model groups and replica choice.

    "smollm2"          -> the default version of smollm2
    "smollm2@2"        -> that version
    "auto"             -> AutoRouteConfig: prompt tokens <= threshold_tokens ? small : large
    group.pick(prompt) -> a replica: the one that was sent the longest leading run of the
                          prompt's full KV blocks (prefix_index.py) reaching past the blocks
                          most prompts share (those in `shared_after` routed prompts: a system
                          prompt), unless it has `overload_slack` more requests in flight than
                          the least loaded one; otherwise the least loaded one (fewest routed
                          breaks ties)
    group.remember(replica, tokens) -> a finished request's prompt + output blocks, which the
                          replica's prefix cache now holds (a conversation's next turn
                          extends them)

So a conversation's next turn follows its previous one (its prompt extends that turn's prompt
and answer), and new conversations that share only a system prompt spread by load.  Load is the
router's own count of requests in flight per replica (exact, no polling) plus what
the replica says is waiting in its engine (covers other routers sharing a remote replica).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, field

from xlaserve.serving.admission import AdmissionController
from xlaserve.serving.engine_api import AsyncEngine
from xlaserve.serving.router.prefix_index import PrefixIndex, block_chain
from xlaserve.serving.server_config import AutoRouteConfig, RouterConfig, ServedModel
from xlaserve.serving.structured.grammar import GrammarCompiler
from xlaserve.serving.tokenizer import Tokenizer
from xlaserve.serving.types import Tier

INDEX_BLOCKS = 1 << 16   # block hashes remembered per replica (~10 MB): past a cache's size


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
    prefixes: PrefixIndex = field(default_factory=lambda: PrefixIndex(INDEX_BLOCKS))

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
    blocks: PrefixIndex = field(default_factory=lambda: PrefixIndex(INDEX_BLOCKS))  # all picks

    @property
    def name(self) -> str:
        return self.config.name

    @property
    def id(self) -> str:
        return self.config.id

    @property
    def tokenizer(self) -> Tokenizer:
        return self.replicas[0].engine.tokenizer

    @functools.cached_property
    def grammars(self) -> GrammarCompiler:
        """Checks the group's requests' output constraints against its tokenizer."""
        return GrammarCompiler(self.tokenizer, self.tokenizer.vocab_size)

    @property
    def max_model_len(self) -> int:
        return min(r.engine.max_model_len for r in self.replicas)

    @property
    def ready(self) -> bool:
        return any(r.engine.ready for r in self.replicas)

    def _chain(self, prompt_ids: Sequence[int], tenant: str) -> list[int]:
        cfg = self.router_config
        return block_chain(prompt_ids, tenant, cfg.block_size, cfg.prefix_blocks)

    def pick(self, prompt_ids: Sequence[int], tenant: str) -> Replica:
        """The replica for a prompt (see the module docstring); it is remembered there."""
        live = [r for r in self.replicas if r.engine.ready] or self.replicas
        least = min(live, key=lambda r: (r.load, r.routed))
        chain = self._chain(prompt_ids, tenant)
        chosen = least
        if chain and len(live) > 1:
            shared = self.blocks.shared(chain, self.router_config.shared_after)
            depth = {id(r): r.prefixes.matched(chain) for r in live}
            best = max(depth.values())
            if best > shared:
                holder = min((r for r in live if depth[id(r)] == best),
                             key=lambda r: (r.load, r.routed))
                if holder.load - least.load < self.router_config.overload_slack:
                    chosen = holder
        chosen.prefixes.add(chain)
        self.blocks.add(chain)
        return chosen

    def remember(self, replica: Replica, token_ids: Sequence[int], tenant: str) -> None:
        """`replica` finished a request over `token_ids` (prompt + output): its cache holds
        their full blocks."""
        replica.prefixes.add(self._chain(token_ids, tenant))


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
