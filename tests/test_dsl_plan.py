"""Parser and planner: every rule is checked before anything runs, with line, column and caret."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine_adapter.dsl import Limits, ProgramError, plan
from engine_adapter.dsl.plan import check_args
from engine_adapter.dsl.syntax import Fork, Gen, If, Message, Select, parse

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


@pytest.mark.parametrize("name", ["chatbot", "map_reduce", "speculative"])
def test_examples_plan(name: str) -> None:
    checked = plan((EXAMPLES / f"{name}.kvs").read_text())
    assert checked.syntax.name == name and checked.calls >= 2


def test_the_design_example_parses_into_typed_nodes() -> None:
    program = parse((EXAMPLES / "chatbot.kvs").read_text())
    assert program.params == ["question"]
    kinds = [type(n) for n in program.body]
    assert kinds[:3] == [Message, Message, Gen] and Fork in kinds
    fork = next(n for n in program.body if isinstance(n, Fork))
    assert isinstance(fork.body[1], Select) and fork.body[1].options == ["Yes", "No"]


def test_if_not_contains_and_comments() -> None:
    source = (
        "program p(x) {\n  # a comment\n  user $x\n  a = gen(max_tokens=4)\n"
        '  if not contains(a, "yes") { yield a } else { yield a }\n}'
    )
    node = parse(source).body[2]
    assert isinstance(node, If) and node.cond.kind == "contains" and node.cond.negated


BAD = [
    ('program p() {\n  user "a"\n  y = gen(max_tokens=)\n}', "syntax error", 3),
    ("program p() {\n  user $q\n}", "undefined parameter 'q'", 2),
    ('program p() {\n  user "hello {who}"\n}', "undefined variable 'who'", 2),
    ("program p() {\n  yield nothing\n}", "yield of unknown name 'nothing'", 2),
    ("program p() {\n  a = gen()\n  wait a\n}", "wait needs fork handles; 'a' is not one", 3),
    ("program p() {\n  kill x\n}", "kill needs a fork handle", 2),
    ("program p() {\n  a = gen(tokens=3)\n}", "gen does not take ['tokens']", 2),
    ('program p() {\n  a = gen(max_tokens="ten")\n}', "max_tokens must be an integer", 2),
    ('program p() {\n  a = gen(type="table")\n}', 'type must be "text" or "list"', 2),
    ("program p() {\n  a = gen(max_items=3)\n}", 'max_items needs type="list"', 2),
    ("program p() {\n  a = gen(temperature=9)\n}", "temperature must be in [0, 5]", 2),
    ("program p() {\n  a = select([])\n}", "distinct, non-empty strings", 2),
    ('program p() {\n  a = select(["x", "x"])\n}', "distinct, non-empty strings", 2),
    ("program p() {\n  a = gen()\n  return a\n}", "return is only allowed inside a fork", 3),
    (
        "program p() {\n  h = fork { a = gen() return a }\n  h = gen()\n}",
        "fork handle and cannot be reassigned",
        3,
    ),
    ('program p() {\n  if x == "a" { }\n}', "if on unknown name 'x'", 2),
    ('program p() {\n  h = fork { a = gen() return a }\n  user "{h}"\n}', "undefined variable 'h'", 3),
    # A name is defined after an `if` only if both branches define it.
    ('program p(a) {\n  if a == "x" { b = gen() }\n  yield b\n}', "yield of unknown name 'b'", 3),
    ('program p(a) {\n  if a == "x" { } else { b = gen() }\n  user "{b}"\n}', "undefined variable 'b'", 3),
    (
        'program p(a) {\n  if a == "x" { b = gen() } else { c = gen() }\n  if b == "y" { }\n}',
        "if on unknown name 'b'",
        3,
    ),
    (
        'program p(a) {\n  if not contains(a, "x") { h = fork { v = gen() return v } }\n  wait h\n}',
        "wait needs fork handles; 'h' is not one",
        3,
    ),
    (
        'program p(a) {\n  h = fork {\n    if a == "x" { v = gen() }\n    return v\n  }\n}',
        "return of unknown name 'v'",
        4,
    ),
]


@pytest.mark.parametrize(("source", "message", "line"), BAD)
def test_every_rule_has_an_error_with_a_caret(source: str, message: str, line: int) -> None:
    with pytest.raises(ProgramError) as info:
        plan(source)
    assert message in str(info.value)
    assert info.value.line == line
    assert "^" in str(info.value).splitlines()[-1]


def _forks(count: int, depth: int = 1) -> str:
    body = "a = gen(max_tokens=2) return a"
    for _ in range(depth - 1):
        body = f"h = fork {{ {body} }} wait h return h"
    forks = "\n".join(f"  f{i} = fork {{ {body} }}" for i in range(count))
    return f"program p() {{\n{forks}\n}}"


@pytest.mark.parametrize(
    ("source", "limits", "message"),
    [
        ("program p() {}", Limits(max_source_bytes=10), "max_source_bytes"),
        (_forks(3), Limits(max_calls=2), "max_calls"),
        (_forks(3), Limits(max_live_branches=2), "max_live_branches"),
        (_forks(1, depth=3), Limits(max_fork_depth=2), "max_fork_depth"),
        ("program p() {\n  a = gen(max_tokens=100)\n  b = gen(max_tokens=100)\n}",
         Limits(max_total_tokens=150), "max_total_tokens"),
    ],
)  # fmt: skip
def test_limits_are_enforced_before_running(source: str, limits: Limits, message: str) -> None:
    with pytest.raises(ProgramError, match=message):
        plan(source, limits)


def test_waited_branches_free_their_live_slot() -> None:
    forks = "\n".join(f"  f{i} = fork {{ a = gen(max_tokens=2) return a }}\n  wait f{i}" for i in range(5))
    assert plan(f"program p() {{\n{forks}\n}}", Limits(max_live_branches=1)).calls == 5


def test_arguments_must_match_parameters() -> None:
    checked = plan((EXAMPLES / "chatbot.kvs").read_text())
    with pytest.raises(ProgramError, match=r"missing arguments \['question'\]"):
        check_args(checked, {})
    with pytest.raises(ProgramError, match=r"unknown arguments \['other'\]"):
        check_args(checked, {"question": "q", "other": "x"})


def test_a_name_defined_on_one_path_only_is_explained() -> None:
    with pytest.raises(ProgramError) as info:
        plan('program p(a) {\n  if a == "x" { b = gen() }\n  yield b\n}')
    assert "defined in only one branch of an if" in str(info.value)
    assert (info.value.line, info.value.column) == (3, 3)
    assert str(info.value).splitlines()[-1] == "    ^"  # under the `y` of `yield`, two spaces in


@pytest.mark.parametrize(
    "body",
    [
        'if a == "x" { b = gen() } else { b = select(["u", "v"]) }\n  yield b',
        'b = gen()\n  if a == "x" { b = gen() }\n  yield b',  # defined before: still defined after
        'if a == "x" { h = fork { v = gen() return v } wait h } else { h = fork { w = gen() return w } '
        "wait h }\n  yield h",
        'if a == "x" { b = gen() yield b }',  # used inside the branch that defines it
    ],
)
def test_names_defined_on_every_path_are_readable_after_the_if(body: str) -> None:
    checked = plan(f"program p(a) {{\n  {body}\n}}")
    assert checked.calls >= 1


def test_forks_in_both_branches_count_as_live_together() -> None:
    body = 'if a == "x" { f = fork { v = gen() return v } } else { g = fork { v = gen() return v } }'
    source = f"program p(a) {{\n  {body}\n  h = fork {{ v = gen() return v }}\n}}"
    assert plan(source, Limits(max_live_branches=3)).calls == 3
    with pytest.raises(ProgramError, match="max_live_branches"):  # the union bounds what may run
        plan(source, Limits(max_live_branches=2))
