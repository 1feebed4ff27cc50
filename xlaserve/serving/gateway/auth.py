"""JWT bearer authentication: HS256 (shared secret) or RS256 (public keys from a PEM file).

Claims used: `exp`, `nbf`, `aud`, `iss` (checked by PyJWT), `tenant` (falls back to `sub`),
`tier` ("free" | "paid" | "internal", default free), `models` (list of model names the token
may use; absent = all).  With mode "none" every caller is the loopback tenant "local", tier
internal (the config refuses "none" on a non-loopback bind).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jwt

from xlaserve.serving.server_config import AuthConfig, parse_tier
from xlaserve.serving.types import Tier


class AuthError(Exception):
    """401: missing, malformed, expired or otherwise invalid credentials."""


@dataclass(frozen=True)
class Principal:
    tenant: str
    tier: Tier
    models: frozenset[str] | None = None   # None = every model

    def may_use(self, model_name: str) -> bool:
        return self.models is None or model_name in self.models or "*" in self.models


_PEM_BLOCK = re.compile(rb"-----BEGIN [A-Z ]*PUBLIC KEY-----.*?-----END [A-Z ]*PUBLIC KEY-----",
                        re.DOTALL)


class Authenticator:
    def __init__(self, config: AuthConfig):
        self.config = config
        self._keys: list[Any] = []
        if config.mode == "hs256":
            secret = config.secret or os.environ.get(config.secret_env, "")
            if not secret:
                raise ValueError(f"auth: environment variable {config.secret_env!r} is empty")
            self._keys = [secret]
        elif config.mode == "rs256":
            from cryptography.hazmat.primitives.serialization import load_pem_public_key

            pem = Path(config.public_key_file).read_bytes()
            self._keys = [load_pem_public_key(b) for b in _PEM_BLOCK.findall(pem)]
            if not self._keys:
                raise ValueError(f"auth.public_key_file={config.public_key_file!r}: "
                                 "no PEM public key found")

    def authenticate(self, authorization: str | None) -> Principal:
        if self.config.mode == "none":
            return Principal(tenant="local", tier=Tier.INTERNAL)
        if not authorization:
            raise AuthError("missing Authorization header (expected 'Bearer <JWT>')")
        scheme, _, token = authorization.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise AuthError("Authorization header must be 'Bearer <JWT>'")
        claims = self._decode(token.strip())
        tenant = claims.get("tenant") or claims.get("sub")
        if not isinstance(tenant, str) or not tenant:
            raise AuthError("token has no 'tenant' or 'sub' claim")
        try:
            tier = parse_tier(claims.get("tier", "free"))
        except ValueError as e:
            raise AuthError(f"token claim {e}") from None
        models = claims.get("models")
        if models is not None and not (isinstance(models, list)
                                       and all(isinstance(m, str) for m in models)):
            raise AuthError("token claim 'models' must be a list of model names")
        return Principal(tenant, tier, frozenset(models) if models is not None else None)

    def _decode(self, token: str) -> dict[str, Any]:
        cfg = self.config
        alg = "HS256" if cfg.mode == "hs256" else "RS256"
        options: Any = {"require": ["exp"], "verify_aud": bool(cfg.audience),
                   "verify_iss": bool(cfg.issuer)}
        last: Exception | None = None
        for key in self._keys:  # rs256: any configured key may have signed (key rotation)
            try:
                return dict(jwt.decode(token, key, algorithms=[alg], options=options,
                                       audience=cfg.audience or None, issuer=cfg.issuer or None,
                                       leeway=cfg.leeway_s))
            except jwt.InvalidSignatureError as e:
                last = e
                continue
            except jwt.ExpiredSignatureError:
                raise AuthError("token expired") from None
            except jwt.ImmatureSignatureError:
                raise AuthError("token not valid yet (nbf)") from None
            except jwt.InvalidAudienceError:
                raise AuthError(f"token audience is not {cfg.audience!r}") from None
            except jwt.InvalidIssuerError:
                raise AuthError(f"token issuer is not {cfg.issuer!r}") from None
            except jwt.MissingRequiredClaimError as e:
                raise AuthError(f"token is missing claim {e.claim!r}") from None
            except jwt.InvalidTokenError as e:
                raise AuthError(f"invalid token: {e}") from None
        raise AuthError(f"invalid token signature ({last})")
