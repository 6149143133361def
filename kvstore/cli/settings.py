"""The one typed place that reads `KVSIEVE_*` environment variables and TOML files.

Every config dataclass of kvsieve is filled the same way: defaults, then a TOML
file, then environment variables, then explicit overrides (CLI flags), each field
converted to its annotated type and validated by the dataclass itself.
"""

from __future__ import annotations

import dataclasses
import os
import tomllib
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

from kvstore.errors import InvalidInputError

T = TypeVar("T")
ENV_PREFIX = "KVSIEVE_"


def build_config(
    cls: type[T],
    toml_path: str | os.PathLike[str] | None = None,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
    section: str | None = None,
) -> T:
    """Build `cls` from defaults < TOML section < KVSIEVE_<FIELD> env vars < overrides.

    Raises:
        InvalidInputError: unknown keys in the TOML file, or a value of the wrong type.
    """
    values: dict[str, Any] = {}
    if toml_path is not None:
        with open(toml_path, "rb") as fh:
            data = tomllib.load(fh)
        table = data.get(section, {}) if section else data
        values.update(_checked_keys(cls, table, f"{toml_path}[{section or ''}]"))
    env = os.environ if env is None else env
    for field in dataclasses.fields(cls):  # type: ignore[arg-type]
        raw = env.get(ENV_PREFIX + field.name.upper())
        if raw is not None:
            values[field.name] = raw
    values.update({k: v for k, v in (overrides or {}).items() if v is not None})
    hints = typing.get_type_hints(cls)
    converted = {name: convert(value, hints[name], name) for name, value in values.items()}
    return cls(**converted)


def _checked_keys(cls: type[Any], table: Mapping[str, Any], where: str) -> dict[str, Any]:
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(table) - names)
    if unknown:
        raise InvalidInputError(f"unknown keys {unknown} in {where}; allowed: {sorted(names)}")
    return dict(table)


def convert(value: Any, hint: Any, name: str) -> Any:
    """Convert a TOML/env/flag value to the field's annotated type."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if value is None or (isinstance(value, str) and value.lower() in ("", "none")):
            return None
        return convert(value, args[0], name)
    try:
        if hint is bool:
            return value if isinstance(value, bool) else str(value).lower() in ("1", "true", "yes", "on")
        if hint is int:
            return parse_bytes(value) if isinstance(value, str) else int(value)
        if hint is float:
            return float(value)
        if hint is Path:
            return Path(value).expanduser()
        if origin is dict or hint is dict:
            return dict(value) if not isinstance(value, str) else _parse_mapping(value)
        if origin is tuple:
            return tuple(value.split(",")) if isinstance(value, str) else tuple(value)
    except (TypeError, ValueError) as exc:
        raise InvalidInputError(f"{name}: cannot read {value!r} as {hint}: {exc}") from exc
    return value


def parse_bytes(text: str) -> int:
    """Parse "1024", "64MiB", "2GiB", "1.5GB" into bytes."""
    units = {"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40,
             "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "b": 1}  # fmt: skip
    lowered = text.strip().lower().replace("_", "")
    for suffix, factor in units.items():
        if lowered.endswith(suffix):
            return int(float(lowered[: -len(suffix)]) * factor)
    return int(lowered)


def _parse_mapping(text: str) -> dict[str, Any]:
    # "token1=ns1|ns2,token2=ns3" -> {"token1": ["ns1", "ns2"], "token2": ["ns3"]}
    out: dict[str, Any] = {}
    for item in filter(None, text.split(",")):
        key, _, value = item.partition("=")
        out[key.strip()] = [v for v in value.split("|") if v]
    return out
