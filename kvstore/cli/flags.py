"""Command-line flags built from the config dataclasses: no second copy of any option.

Each field becomes `--field-name`; its help is the field's line under
"Attributes:" in the class docstring. Unset flags stay None so that TOML files and
environment variables underneath still apply (see kvstore.cli.settings).

Also the small vocabulary that command plugins use to add their commands to
`kvsieve` (`add_command`, `DeferredParser`; see kvstore.cli.main).
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import os
import re
import typing
from collections.abc import Callable, Mapping
from typing import Any, TypeAlias, TypeVar

from kvstore.cli.settings import ENV_PREFIX, convert
from kvstore.errors import InvalidInputError

T = TypeVar("T")


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
    parser: argparse.ArgumentParser,
    cls: type[Any],
    title: str,
    skip: tuple[str, ...] = (),
    defaults: Mapping[str, Any] | None = None,
) -> None:
    """Add one flag per field of `cls` to a group of `parser`.

    `defaults` names the fields whose default the command replaces (shown in the help
    instead of the dataclass's; the command applies them itself).
    """
    group = parser.add_argument_group(title)
    docs = field_docs(cls)
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        default = f.default if f.default is not dataclasses.MISSING else "{}"
        default = (defaults or {}).get(f.name, default)
        flag = "--" + f.name.replace("_", "-")
        help_text = f"{docs.get(f.name, '')} (default: {default})".replace("%", "%%")
        if hints[f.name] is bool:
            group.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=help_text)
        else:
            group.add_argument(flag, default=None, metavar=f.name.upper(), help=help_text)


def overrides(args: argparse.Namespace, cls: type[Any]) -> dict[str, Any]:
    """The flags of `cls` that were given, as raw values for kvstore.cli.settings.build_config."""
    return {
        f.name: getattr(args, f.name)
        for f in dataclasses.fields(cls)
        if getattr(args, f.name, None) is not None
    }


def parameter_default(func: Callable[..., Any], name: str) -> Any:
    """The default of `func`'s parameter `name`: a flag's default read from the code that uses it."""
    return inspect.signature(func).parameters[name].default


def build_from_flags_and_env(
    cls: type[T],
    args: argparse.Namespace,
    env: Mapping[str, str] | None = None,
    check: Callable[[str, Any], None] | None = None,
) -> T:
    """`cls` from its defaults < `KVSIEVE_<FIELD>` variables < its flags (see `add_flags`).

    Unlike kvstore.cli.settings.build_config, a value that cannot be read, or that the
    dataclass (or `check(field, value)`, raising ValueError) refuses, is reported
    with the flag or variable it came from.

    Raises:
        InvalidInputError: names the flag or variable and the value.
    """
    env = os.environ if env is None else env
    hints = typing.get_type_hints(cls)
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        source, raw = _source(f.name, args, env)
        if raw is None:
            continue
        try:
            values[f.name] = convert(raw, hints[f.name], f.name)
            cls(**{f.name: values[f.name]})  # the dataclass's own check, blamed on this source
            if check is not None:
                check(f.name, values[f.name])
        except (InvalidInputError, TypeError, ValueError) as exc:
            raise InvalidInputError(f"{source}={raw!r}: {exc}") from exc
    return cls(**values)


def _source(name: str, args: argparse.Namespace, env: Mapping[str, str]) -> tuple[str, Any]:
    """Where field `name`'s value comes from (flag first, then variable), and the raw value."""
    flag = getattr(args, name, None)
    if flag is not None:
        return "--" + name.replace("_", "-"), flag
    variable = ENV_PREFIX + name.upper()
    return variable, env.get(variable)


class DeferredParser(argparse.ArgumentParser):
    """A command's parser whose flags are added when that command is used (parsed or helped).

    Why: a command's flags are built from the dataclasses that own the defaults, and
    some live in modules that import torch; `kvsieve --help` must not pay for them.
    """

    def __init__(self, *args: Any, flags: Callable[[argparse.ArgumentParser], None] | None = None,
                 **kwargs: Any) -> None:  # fmt: skip
        super().__init__(*args, **kwargs)
        self._pending_flags = flags

    def add_pending_flags(self) -> None:
        """Add the command's flags now (once)."""
        flags, self._pending_flags = self._pending_flags, None
        if flags is not None:
            flags(self)

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> tuple[Any, list[str]]:
        self.add_pending_flags()
        return super().parse_known_args(args, namespace)

    def format_usage(self) -> str:
        self.add_pending_flags()
        return super().format_usage()

    def format_help(self) -> str:
        self.add_pending_flags()
        return super().format_help()


Subcommands: TypeAlias = "argparse._SubParsersAction[DeferredParser]"
"""What kvstore.cli.main hands to every command plugin: `add_subparsers(parser_class=DeferredParser)`."""


def add_command(
    commands: Subcommands,
    name: str,
    flags: Callable[[argparse.ArgumentParser], None],
    handler: Callable[[argparse.Namespace], int],
    **parser_kwargs: Any,
) -> None:
    """Add command `name`: `flags(parser)` adds its flags when it is used; `handler(args)` runs it.

    Args:
        commands: the subcommands object that `kvsieve` hands to every command plugin.
        name: the command word.
        flags: adds the command's arguments to its parser (deferred, see DeferredParser).
        handler: runs the command and returns its exit code.
        **parser_kwargs: `help` (the line in `kvsieve --help`), `description`, ...
    """
    parser = commands.add_parser(name, flags=flags, **parser_kwargs)
    parser.set_defaults(handler=handler)
