"""Parse: program text -> a syntax tree of small typed nodes. Knows no model and no limits.

The grammar is declarative: messages, gen, select, fork/wait/yield/kill, if with
== / contains / not, and no loops, so every program terminates.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from functools import cache
from typing import Any

from engine_adapter.dsl.errors import ProgramError

KEYWORDS = (
    "program", "gen", "select", "fork", "wait", "yield", "kill", "return",
    "if", "else", "contains", "not", "system", "user", "assistant",
)  # fmt: skip

# Blocks inside blocks, at most. Far beyond any real program, and far below the
# recursion the tree conversion and the planner would need to fail on.
MAX_NESTING = 32
_BRACES = re.compile(r'"(?:\\.|[^"\\])*"|#[^\n]*|[{}]')

GRAMMAR = r"""
start: "program" NAME "(" [NAME ("," NAME)*] ")" block
block: "{" stmt* "}"
?stmt: message | gen_stmt | select_stmt | fork_stmt | wait_stmt | yield_stmt | kill_stmt
     | if_stmt | return_stmt
message: ROLE value
gen_stmt: NAME "=" "gen" "(" [kwarg ("," kwarg)*] ")"
select_stmt: NAME "=" "select" "(" list ("," kwarg)* ")"
fork_stmt: NAME "=" "fork" block
wait_stmt: "wait" NAME ("," NAME)*
yield_stmt: "yield" NAME ("," NAME)*
kill_stmt: "kill" NAME
return_stmt: "return" NAME
if_stmt: "if" cond block ["else" block]
?cond: NOT cond -> negate
     | NAME "==" STRING -> equals
     | "contains" "(" NAME "," STRING ")" -> contains
kwarg: NAME "=" literal
?literal: STRING -> string
        | SIGNED_NUMBER -> number
        | list
list: "[" [literal ("," literal)*] "]"
?value: STRING -> string
      | VAR -> var
ROLE: "system" | "user" | "assistant"
NOT.2: "not"
VAR: "$" NAME
STRING: /"(\\.|[^"\\])*"/
NAME: /(?!(KEYWORDS)\b)[a-zA-Z_][a-zA-Z0-9_]*/
COMMENT: /#[^\n]*/
%import common.SIGNED_NUMBER
%import common.WS
%ignore WS
%ignore COMMENT
"""


@dataclass(frozen=True)
class Node:
    """Base of every syntax node: where it starts in the source."""

    line: int
    column: int


@dataclass(frozen=True)
class Text(Node):
    """A string literal (may contain {name} placeholders) or a $parameter."""

    value: str
    is_param: bool = False


@dataclass(frozen=True)
class Message(Node):
    role: str
    text: Text


@dataclass(frozen=True)
class Gen(Node):
    target: str
    kwargs: dict[str, Any]


@dataclass(frozen=True)
class Select(Node):
    target: str
    options: list[Any]
    kwargs: dict[str, Any]


@dataclass(frozen=True)
class Fork(Node):
    target: str
    body: list[Node]


@dataclass(frozen=True)
class Wait(Node):
    names: list[str]


@dataclass(frozen=True)
class Yield(Node):
    names: list[str]


@dataclass(frozen=True)
class Kill(Node):
    name: str


@dataclass(frozen=True)
class Return(Node):
    name: str


@dataclass(frozen=True)
class Cond(Node):
    """`name == text`, `contains(name, text)`, or either negated."""

    kind: str  # "equals" | "contains"
    name: str
    text: str
    negated: bool = False


@dataclass(frozen=True)
class If(Node):
    cond: Cond
    then: list[Node]
    otherwise: list[Node] = field(default_factory=list)


@dataclass(frozen=True)
class ProgramSyntax:
    """A parsed program."""

    name: str
    params: list[str]
    body: list[Node]
    source: str


def parse(source: str) -> ProgramSyntax:
    """Parse program text. Raises ProgramError with line, column and a caret snippet."""
    import lark

    _check_nesting(source)
    parser = _parser()
    try:
        tree = parser.parse(source)
    except lark.exceptions.UnexpectedInput as exc:
        expected = sorted(getattr(exc, "expected", []) or getattr(exc, "allowed", []) or [])
        hint = f" (expected one of: {', '.join(expected[:8])})" if expected else ""
        raise ProgramError(f"syntax error{hint}", source, exc.line, exc.column) from None
    name, *rest = tree.children
    block = rest[-1]
    params = [str(p) for p in rest[:-1] if p is not None]
    try:
        body = _block(block)
    except ProgramError as exc:  # raised deep in the tree, where the source is not at hand
        raise ProgramError(exc.message, source, exc.line, exc.column) from None
    return ProgramSyntax(str(name), params, body, source)


def _check_nesting(source: str) -> None:
    """ProgramError at the first `{` nested deeper than MAX_NESTING (strings and comments skipped)."""
    depth = 0
    for match in _BRACES.finditer(source):
        text = match.group()
        if text == "{":
            depth += 1
            if depth > MAX_NESTING:
                line = source.count("\n", 0, match.start()) + 1
                column = match.start() - (source.rfind("\n", 0, match.start()) + 1) + 1
                raise ProgramError(f"blocks nested deeper than {MAX_NESTING}", source, line, column)
        elif text == "}":
            depth -= 1


@cache
def _parser() -> Any:
    """The LALR parser; building its tables takes ~50 ms, so once per process."""
    import lark

    return lark.Lark(GRAMMAR.replace("KEYWORDS", "|".join(KEYWORDS)), parser="lalr", propagate_positions=True)


def _block(tree: Any) -> list[Node]:
    return [_stmt(child) for child in tree.children]


def _pos(tree: Any) -> tuple[int, int]:
    meta = getattr(tree, "meta", None)
    if meta is not None and not getattr(meta, "empty", True):
        return meta.line, meta.column
    token = getattr(tree, "line", None)
    return (tree.line, tree.column) if token else (0, 0)


def _stmt(tree: Any) -> Node:
    line, column = _pos(tree)
    kind, ch = tree.data, tree.children
    if kind == "message":
        return Message(line, column, str(ch[0]), _text(ch[1]))
    if kind == "gen_stmt":
        return Gen(line, column, str(ch[0]), _kwargs(ch[1:]))
    if kind == "select_stmt":
        return Select(line, column, str(ch[0]), _literal(ch[1]), _kwargs(ch[2:]))
    if kind == "fork_stmt":
        return Fork(line, column, str(ch[0]), _block(ch[1]))
    if kind == "wait_stmt":
        return Wait(line, column, [str(c) for c in ch])
    if kind == "yield_stmt":
        return Yield(line, column, [str(c) for c in ch])
    if kind == "kill_stmt":
        return Kill(line, column, str(ch[0]))
    if kind == "return_stmt":
        return Return(line, column, str(ch[0]))
    if kind == "if_stmt":
        otherwise = _block(ch[2]) if len(ch) > 2 and ch[2] is not None else []
        return If(line, column, _cond(ch[0]), _block(ch[1]), otherwise)
    raise ProgramError(f"unknown statement {kind}", "", line, column)


def _cond(tree: Any) -> Cond:
    line, column = _pos(tree)
    negated = False
    while tree.data == "negate":  # a loop, not recursion: `not not ... not` may be long
        negated, tree = not negated, tree.children[-1]
    name, text = tree.children
    return Cond(line, column, str(tree.data), str(name), _unquote(text), negated)


def _text(tree: Any) -> Text:
    line, column = _pos(tree)
    token = tree.children[0]
    if tree.data == "var":
        return Text(line, column, str(token)[1:], is_param=True)
    return Text(line, column, _unquote(token))


def _kwargs(children: list[Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for kwarg in children:
        if kwarg is None:
            continue
        name, value = kwarg.children
        if str(name) in out:
            line, column = _pos(kwarg)
            raise ProgramError(f"argument {name!s} given twice", "", line, column)
        out[str(name)] = _literal(value)
    return out


def _literal(tree: Any) -> Any:
    if tree.data == "string":
        return _unquote(tree.children[0])
    if tree.data == "number":
        token = tree.children[0]
        text = str(token)
        try:
            return float(text) if any(c in text for c in ".eE") else int(text)
        except ValueError as exc:  # e.g. an integer of thousands of digits
            raise ProgramError(f"bad number: {exc}", "", token.line, token.column) from None
    return [_literal(c) for c in tree.children if c is not None]


def _unquote(token: Any) -> str:
    """A string literal's value (JSON escapes); ProgramError at the literal if it has bad ones."""
    try:
        return str(json.loads(str(token)))
    except ValueError as exc:
        reason = getattr(exc, "msg", str(exc))
        raise ProgramError(f"bad string literal: {reason}", "", token.line, token.column) from None
