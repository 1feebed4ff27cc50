"""A server config file (TOML or JSON, the layout in server_config.py's docstring) -> a
`ServerConfig`: every value type-checked against its field's annotation before the dataclasses
validate what it means, errors naming the section and key."""

from __future__ import annotations

import json
import tomllib
from collections.abc import Mapping
from dataclasses import fields, replace
from pathlib import Path
from types import UnionType
from typing import Any, Union, get_args, get_origin, get_type_hints

from xlaserve.serving.server_config import (
    AdmissionConfig,
    AuditConfig,
    AuthConfig,
    AutoRouteConfig,
    GrpcClientConfig,
    RouterConfig,
    ServedModel,
    ServerConfig,
    TierLimits,
    TracingConfig,
)


def _typed(hint: Any, value: Any, what: str) -> Any:
    """`value` checked against the field annotation `hint`, as TOML/JSON give it: a bool is
    only a bool, an int never a bool, a float may be written as an int, a tuple field is an
    array.  Returns the value to construct with (arrays become tuples, ints become floats)."""
    origin, args = get_origin(hint), get_args(hint)
    if origin in (Union, UnionType):
        if value is None and type(None) in args:
            return None
        (hint,) = [a for a in args if a is not type(None)]
        return _typed(hint, value, what)
    if hint is bool:
        ok, expected = isinstance(value, bool), "true or false"
    elif hint is int:
        ok, expected = isinstance(value, int) and not isinstance(value, bool), "an integer"
    elif hint is float:
        ok = isinstance(value, int | float) and not isinstance(value, bool)
        expected, value = "a number", float(value) if ok else value
    elif hint is str:
        ok, expected = isinstance(value, str), "a string"
    elif origin is tuple:
        if not isinstance(value, list | tuple):
            raise ValueError(f"{what}={value!r}: expected an array")
        return tuple(_typed(args[0], v, f"{what}[{i}]") for i, v in enumerate(value))
    elif origin is Mapping:
        if not isinstance(value, dict):
            raise ValueError(f"{what}={value!r}: expected a table")
        return {k: _typed(args[1], v, f"{what}.{k}") for k, v in value.items()}
    else:  # Any, or a nested config built from its own table
        return value
    if not ok:
        raise ValueError(f"{what}={value!r}: expected {expected}")
    return value


def _typed_fields(cls: type, data: Mapping[str, Any], where: str) -> dict[str, Any]:
    """`data` with every value checked against `cls`'s field annotation (see `_typed`)."""
    hints = get_type_hints(cls)
    return {k: _typed(hints[k], v, f"{where}.{k}") for k, v in data.items()}


# The sections a file may hold besides [server], [limits.<tier>] and [[models]]: each one
# table that builds the ServerConfig field of the same name.
_SECTIONS: dict[str, type] = {
    "auth": AuthConfig, "admission": AdmissionConfig, "router": RouterConfig,
    "auto": AutoRouteConfig, "audit": AuditConfig, "grpc": GrpcClientConfig,
    "tracing": TracingConfig,
}


def _check_table(data: Any, names: set[str], where: str) -> None:
    """`data` is a table whose keys are all in `names`."""
    if not isinstance(data, dict):
        raise ValueError(f"{where}: expected a table, got {type(data).__name__}")  # noqa: TRY004
    unknown = sorted(set(data) - names)
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {unknown}; known: {sorted(names)}")


def _build(cls: type, data: Any, where: str) -> Any:
    _check_table(data, {f.name for f in fields(cls)}, where)
    kw = _typed_fields(cls, data, where)
    try:
        return cls(**kw)
    except TypeError as e:
        raise ValueError(f"{where}: {e}") from None


def config_from_dict(data: Mapping[str, Any]) -> ServerConfig:
    """Build a ServerConfig from the file layout in the module docstring."""
    known = {"server", "limits", "models", *_SECTIONS}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(f"config: unknown section(s) {unknown}; known: {sorted(known)}")
    server = data.get("server", {})
    _check_table(server, {f.name for f in fields(ServerConfig)} - known, "[server]")
    kw: dict[str, Any] = _typed_fields(ServerConfig, server, "[server]")
    for section, kind in (("limits", dict), ("models", list)):
        if section in data and not isinstance(data[section], kind):
            raise ValueError(f"[{section}]: expected {'a table' if kind is dict else 'an array'}"
                             f", got {type(data[section]).__name__}")
    for name, cls in _SECTIONS.items():
        if name in data:
            kw[name] = _build(cls, data[name], f"[{name}]")
    if "limits" in data:
        kw["limits"] = {t: _build(TierLimits, v, f"[limits.{t}]")
                        for t, v in data["limits"].items()}
    kw["models"] = tuple(_build(ServedModel, m, f"[[models]] #{i}")
                         for i, m in enumerate(data.get("models", [])))
    return ServerConfig(**kw)


def with_model_overrides(config: ServerConfig, *, mesh: str | None = None,
                         dtype: str | None = None) -> ServerConfig:
    """`config` with the command line's --mesh / --dtype set on every model (checked as the
    config's own values are)."""
    def one(m: ServedModel) -> ServedModel:
        if mesh:
            m = replace(m, engine_args={**m.engine_args, "mesh": mesh})
        return replace(m, dtype=dtype) if dtype else m

    return replace(config, models=tuple(one(m) for m in config.models))


def load_serve_config(path: str | Path) -> tuple[ServerConfig, Mapping[str, Any] | None]:
    """A `.toml` or `.json` server config file, and its `[distributed]` table (None when
    absent), which is the command's business rather than the ServerConfig's."""
    path = Path(path)
    text = path.read_text()
    try:
        data = json.loads(text) if path.suffix == ".json" else tomllib.loads(text)
        table = data.pop("distributed", None)
        if table is not None and not isinstance(table, dict):
            raise ValueError(f"[distributed]: expected a table, got {type(table).__name__}")
        return config_from_dict(data), table
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None


def load_config(path: str | Path) -> ServerConfig:
    """Read a `.toml` or `.json` server config file (a `[distributed]` table left aside)."""
    return load_serve_config(path)[0]
