"""Command-line flags built from the config dataclasses: no second copy of any option.

Each field becomes `--field-name`; its help is the field's line under
"Attributes:" in the class docstring. Unset flags stay None so that TOML files and
environment variables underneath still apply (see kvstore.settings).
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import typing
from typing import Any


def field_docs(cls: type[Any]) -> dict[str, str]:
    """Field name -> description, parsed from the Google-style docstring."""
    docs: dict[str, str] = {}
    current = None
    for line in (cls.__doc__ or "").splitlines():
        match = re.match(r"\s{4,8}(\w+): (.*)", line)
        if match:
            current = match.group(1)
            docs[current] = match.group(2).strip()
        elif current and line.strip() and line.startswith(" " * 12):
            docs[current] += " " + line.strip()
    return docs


def add_flags(
    parser: argparse.ArgumentParser, cls: type[Any], title: str, skip: tuple[str, ...] = ()
) -> None:
    """Add one flag per field of `cls` to a group of `parser`."""
    group = parser.add_argument_group(title)
    docs = field_docs(cls)
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        default = f.default if f.default is not dataclasses.MISSING else "{}"
        flag = "--" + f.name.replace("_", "-")
        help_text = f"{docs.get(f.name, '')} (default: {default})".replace("%", "%%")
        if hints[f.name] is bool:
            group.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=help_text)
        else:
            group.add_argument(flag, default=None, metavar=f.name.upper(), help=help_text)


def overrides(args: argparse.Namespace, cls: type[Any]) -> dict[str, Any]:
    """The flags of `cls` that were given, as raw values for kvstore.settings.build_config."""
    return {
        f.name: getattr(args, f.name)
        for f in dataclasses.fields(cls)
        if getattr(args, f.name, None) is not None
    }
