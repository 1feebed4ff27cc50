"""Server configuration: small frozen dataclasses, validated on construction, loaded from a TOML
or JSON file (presets in `configs/`; reading: serving/config_file.py).  Defaults live here; a
file names only what it changes.

    [server]            host, port, tls_cert, tls_key, max_body_bytes, max_n, drain_timeout_s
    [auth]              mode = "none" | "hs256" | "rs256", secret / secret_env / public_key_file,
                        audience, issuer
    [limits.<tier>]     requests_per_minute, tokens_per_minute, tokens_per_day  (0 = unlimited)
    [admission]         slo_wait_s.<tier>, max_queue_wait_s
    [router]            block_size, prefix_blocks, shared_after, overload_slack
    [auto]              small, large, threshold_tokens   (the model "auto")
    [audit]             path, include_prompts
    [grpc]              tls_ca, tls_cert, tls_key, token_env   (how grpc:// replicas are dialled)
    [tracing]           otlp_endpoint, service_name   (OpenTelemetry spans; off by default)
    [[models]]          name, version, default, path, engine, replicas, tiers, max_inflight,
                        max_queue, engine_args, dtype, quantization, spawn_workers
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from xlaserve.models.quantize import check_quantization
from xlaserve.serving.types import Tier

TIER_NAMES = {t.name.lower(): t for t in Tier}
# the engine factory of a [[models]] table without `engine`; engine_args: EngineConfig.from_args
BUILTIN_ENGINE = "xlaserve.serving.engine.factory:threaded_engines"
DTYPES = (None, "auto", "float32", "bfloat16", "float16")   # a served model's weight dtype


def parse_tier(name: str) -> Tier:
    try:
        return TIER_NAMES[name.lower()]
    except (KeyError, AttributeError):
        raise ValueError(f"tier={name!r}: must be one of {sorted(TIER_NAMES)}") from None


def is_loopback(host: str) -> bool:
    """Is `host` ("localhost", an IP address, IPv6 also in brackets) a loopback address?"""
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def target_host(target: str) -> str:
    """The host of a gRPC target "host:port" (of "[v6]:port": "[v6]")."""
    host, sep, _ = target.rpartition(":")
    return host if sep else target


@dataclass(frozen=True)
class AuthConfig:
    mode: str = "none"            # none | hs256 | rs256
    secret: str = ""              # hs256 secret (prefer secret_env)
    secret_env: str = ""          # name of an environment variable holding the hs256 secret
    public_key_file: str = ""     # rs256: PEM file with one or more public keys
    audience: str = ""            # required `aud` when set
    issuer: str = ""              # required `iss` when set
    leeway_s: float = 0.0         # clock skew allowed on exp / nbf

    def __post_init__(self) -> None:
        if self.mode not in ("none", "hs256", "rs256"):
            raise ValueError(f"auth.mode={self.mode!r}: must be none, hs256 or rs256")
        if self.mode == "hs256" and not (self.secret or self.secret_env):
            raise ValueError("auth.mode='hs256' needs auth.secret or auth.secret_env")
        if self.mode == "rs256" and not self.public_key_file:
            raise ValueError("auth.mode='rs256' needs auth.public_key_file")


@dataclass(frozen=True)
class TierLimits:
    requests_per_minute: float = 0.0   # token bucket of this size, refilled per minute; 0 = off
    tokens_per_minute: float = 0.0     # prompt + completion tokens; 0 = off
    tokens_per_day: int = 0            # daily quota (UTC day); 0 = off

    def __post_init__(self) -> None:
        for f in fields(self):
            if getattr(self, f.name) < 0:
                raise ValueError(f"limits.{f.name}={getattr(self, f.name)!r}: must be >= 0")


@dataclass(frozen=True)
class AdmissionConfig:
    # A request is rejected when its expected queue wait exceeds its tier's SLO.
    slo_wait_s: Mapping[str, float] = field(
        default_factory=lambda: {"free": 2.0, "paid": 10.0, "internal": 30.0})
    max_queue_wait_s: float = 60.0     # hard bound on any wait in the queue

    def __post_init__(self) -> None:
        for name, v in self.slo_wait_s.items():
            parse_tier(name)
            if not v > 0:
                raise ValueError(f"admission.slo_wait_s.{name}={v!r}: must be > 0")
        if not self.max_queue_wait_s > 0:
            raise ValueError(f"admission.max_queue_wait_s={self.max_queue_wait_s!r}: must be > 0")

    def slo(self, tier: Tier) -> float:
        return float(self.slo_wait_s.get(tier.name.lower(), self.max_queue_wait_s))


@dataclass(frozen=True)
class RouterConfig:
    block_size: int = 16        # tokens per KV block (the router matches whole blocks)
    prefix_blocks: int = 64     # most leading blocks of a prompt matched against the replicas
    shared_after: int = 4       # a block in this many routed prompts is a shared prefix (a
                                # system prompt): it ties no prompt to the replica holding it
    overload_slack: int = 4     # leave the replica holding the prefix when it has this many
                                # more requests in flight than the least loaded one

    def __post_init__(self) -> None:
        if min(self.block_size, self.prefix_blocks, self.shared_after) < 1 \
                or self.overload_slack < 0:
            raise ValueError(f"router: block_size={self.block_size}, prefix_blocks="
                             f"{self.prefix_blocks}, shared_after={self.shared_after} must be "
                             f">= 1, overload_slack={self.overload_slack} >= 0")


@dataclass(frozen=True)
class AutoRouteConfig:
    """Model "auto": prompts of at most `threshold_tokens` tokens go to `small`, others to
    `large`.  The choice is reported in the `x-xlaserve-routed-model` response header."""

    small: str
    large: str
    threshold_tokens: int = 512

    def __post_init__(self) -> None:
        if self.threshold_tokens < 0:
            raise ValueError(f"auto.threshold_tokens={self.threshold_tokens}: must be >= 0")


@dataclass(frozen=True)
class AuditConfig:
    path: str = ""                # JSONL file; "" = no audit log
    include_prompts: bool = False


@dataclass(frozen=True)
class TracingConfig:
    """`[tracing]`: where spans go.  "" (the default): nowhere, tracing is off."""

    otlp_endpoint: str = ""          # e.g. http://127.0.0.1:4318/v1/traces (OTLP over HTTP)
    service_name: str = "xlaserve"

    def __post_init__(self) -> None:
        if self.otlp_endpoint and not self.otlp_endpoint.startswith(("http://", "https://")):
            raise ValueError(f"[tracing] otlp_endpoint={self.otlp_endpoint!r}: expected an "
                             "http(s):// URL of an OTLP/HTTP collector")
        if not self.service_name:
            raise ValueError("[tracing] service_name must not be empty")


@dataclass(frozen=True)
class GrpcClientConfig:
    """How the front end dials its grpc:// replicas (serving/grpc/auth.py draws the hop): over
    TLS trusting `tls_ca`, with a client certificate for workers that require one, and with
    the bearer token read from the environment variable `token_env` ("": XLASERVE_GRPC_TOKEN
    when set; a variable named here must be set).  A non-loopback replica needs `tls_ca`."""

    tls_ca: str = ""       # PEM: the CA that signed the workers' certificates; "" = no TLS
    tls_cert: str = ""     # PEM: this front end's client certificate (mTLS)
    tls_key: str = ""      # PEM: its private key
    token_env: str = ""    # the token's variable; the token itself never goes in a file

    def __post_init__(self) -> None:
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("grpc.tls_cert and grpc.tls_key must be given together")
        if self.tls_cert and not self.tls_ca:
            raise ValueError(f"grpc.tls_cert={self.tls_cert!r} needs grpc.tls_ca: a client "
                             "certificate is only sent over TLS")
        if self.token_env and not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", self.token_env):
            # not echoed: a token pasted here by mistake would end up in the logs
            raise ValueError("grpc.token_env: not an environment variable name (letters, "
                             "digits, '_'); it names the variable that holds the token")

    def check_target(self, target: str) -> None:
        """Refuse (ValueError) a plaintext hop to `target` ("host:port") beyond loopback."""
        host = target_host(target)
        if not self.tls_ca and not is_loopback(host):
            raise ValueError(f"grpc://{target}: {host!r} is not a loopback address and "
                             "grpc.tls_ca is not set: requests (tenant, tier) and the token "
                             "would cross the network in the clear; set [grpc] tls_ca to the "
                             "CA that signed the workers' certificates")


REMOTE_SCHEMES = ("grpc://", "prefill://", "decode://")


def replica_target(replica: str) -> str:
    """"grpc://host:port" (or prefill://, decode://) -> "host:port"."""
    return replica.split("://", 1)[1]


@dataclass(frozen=True)
class ServedModel:
    name: str
    version: str = "1"
    default: bool = True          # requests naming just `name` get this version
    path: str = ""                # model folder (weights, tokenizer); for grpc replicas the
                                  # tokenizer is loaded from here too
    engine: str = BUILTIN_ENGINE  # "module:function" building a local engine: fn(ServedModel)
    # "local" or "grpc://host:port", one per replica; "prefill://host:port" and
    # "decode://host:port" workers together make one replica that splits each request
    # between them (serving/disagg/)
    replicas: tuple[str, ...] = ("local",)
    tiers: tuple[str, ...] = ()   # tiers allowed to use this model; () = all
    max_inflight: int = 64        # per replica: requests handed to the engine at once
    max_queue: int = 256          # admission queue bound for the whole model
    engine_args: Mapping[str, Any] = field(default_factory=dict)
    dtype: str | None = "auto"    # auto: float32 on CPU (its fast one), bfloat16 on a GPU;
                                  # float32 | bfloat16 | float16; None: the model folder's
    quantization: str | None = None   # "int8": weight-only int8 (a float folder is quantized
                                      # as it loads); None: the model folder's
    spawn_workers: bool = False   # `xlaserve serve` starts the prefill:// and decode://
                                  # workers (loopback) as its child processes

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"models[{self.name}].dtype={self.dtype!r}: choose from "
                             f"{[d for d in DTYPES if d]} (left out: auto)")
        check_quantization(self.quantization, f"models[{self.name}].quantization")
        if not self.name or "@" in self.name or self.name == "auto":
            raise ValueError(f"models.name={self.name!r}: must be non-empty, without '@', "
                             "and not 'auto'")
        if not self.replicas:
            raise ValueError(f"models[{self.name}].replicas: at least one replica")
        for r in self.replicas:
            if r != "local" and not r.startswith(REMOTE_SCHEMES):
                raise ValueError(f"models[{self.name}].replicas: {r!r} is not 'local', "
                                 "'grpc://host:port', 'prefill://host:port' or "
                                 "'decode://host:port'")
        roles = {r.split("://")[0] for r in self.replicas} & {"prefill", "decode"}
        if roles and roles != {"prefill", "decode"}:
            raise ValueError(f"models[{self.name}].replicas: prefill:// and decode:// workers "
                             f"come together; only {sorted(roles)} given")
        if self.spawn_workers and not roles:
            raise ValueError(f"models[{self.name}].spawn_workers: no prefill:// or decode:// "
                             "replicas to start")
        for t in self.tiers:
            parse_tier(t)
        if self.max_inflight < 1 or self.max_queue < 0:
            raise ValueError(f"models[{self.name}]: max_inflight={self.max_inflight} must be "
                             f">= 1 and max_queue={self.max_queue} >= 0")
        if self.engine == BUILTIN_ENGINE and self.engine_args:
            # checked here rather than when the engine is built, minutes later
            from xlaserve.serving.engine.config import EngineConfig

            known = EngineConfig.arg_names()
            unknown = sorted(set(self.engine_args) - known)
            if unknown:
                raise ValueError(f"models[{self.name}].engine_args: unknown key(s) {unknown}; "
                                 f"known: {sorted(known)}")

    @property
    def id(self) -> str:
        return f"{self.name}@{self.version}"

    def allows(self, tier: Tier) -> bool:
        return not self.tiers or tier.name.lower() in self.tiers


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    tls_cert: str = ""
    tls_key: str = ""
    max_body_bytes: int = 1 << 20
    max_n: int = 8                # most choices (n * prompts) one request may ask for
    drain_timeout_s: float = 30.0  # on SIGTERM: how long running requests may still finish
    auth: AuthConfig = field(default_factory=AuthConfig)
    limits: Mapping[str, TierLimits] = field(default_factory=dict)
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)
    router: RouterConfig = field(default_factory=RouterConfig)
    auto: AutoRouteConfig | None = None
    audit: AuditConfig = field(default_factory=AuditConfig)
    grpc: GrpcClientConfig = field(default_factory=GrpcClientConfig)
    tracing: TracingConfig = field(default_factory=TracingConfig)
    models: tuple[ServedModel, ...] = ()

    def __post_init__(self) -> None:
        if self.auth.mode == "none" and not is_loopback(self.host):
            raise ValueError(f"server.host={self.host!r} is not a loopback address and auth.mode "
                             "is 'none': refusing to serve without authentication (set "
                             "[auth] mode = 'hs256' or 'rs256', or bind 127.0.0.1)")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("server.tls_cert and server.tls_key must be given together")
        if not 0 <= self.port < 65536:
            raise ValueError(f"server.port={self.port}: must be in 0..65535")
        if self.max_body_bytes < 1024 or self.max_n < 1:
            raise ValueError(f"server.max_body_bytes={self.max_body_bytes} must be >= 1024, "
                             f"max_n={self.max_n} >= 1")
        if not 0 <= self.drain_timeout_s <= 3600:
            raise ValueError(f"server.drain_timeout_s={self.drain_timeout_s}: must be in "
                             "0..3600 seconds")
        for t in self.limits:
            parse_tier(t)
        for m in self.models:
            for r in m.replicas:
                if r != "local":
                    self.grpc.check_target(replica_target(r))
        ids = [m.id for m in self.models]
        if len(set(ids)) != len(ids):
            raise ValueError(f"models: duplicate name@version in {ids}")
        for name in {m.name for m in self.models}:
            defaults = [m for m in self.models if m.name == name and m.default]
            if len(defaults) > 1:
                raise ValueError(f"models[{name}]: more than one version has default = true")
        if self.auto is not None:
            names = {m.name for m in self.models}
            for side in (self.auto.small, self.auto.large):
                if side not in names:
                    raise ValueError(f"auto: model {side!r} is not in models {sorted(names)}")

    def tier_limits(self, tier: Tier) -> TierLimits:
        return self.limits.get(tier.name.lower(), TierLimits())
