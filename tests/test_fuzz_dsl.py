"""Fuzzing the DSL's parser and planner: any text, and programs shaped by the grammar.

Whatever the input, `plan` either returns a plan within the Limits or raises
ProgramError with a position; never another exception (a traceback on the server).
"""

from __future__ import annotations

import os
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine_adapter.dsl import Limits, ProgramError, plan
from engine_adapter.dsl.syntax import Fork, If, Node

FUZZ = settings(
    max_examples=int(os.environ.get("KVSIEVE_FUZZ_EXAMPLES", "150")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
LIMITS = Limits(
    max_source_bytes=4096, max_calls=6, max_live_branches=2, max_fork_depth=2, max_total_tokens=300
)
NAMES = st.sampled_from(["a", "b", "h", "x", "v"])
WORDS = st.sampled_from(["hello", "{a}", "{h}", "{q}", "yes", "\\n", "\\q", "\\u12", "\n"])


def _plan_or_error(source: str, limits: Limits = LIMITS) -> Any:
    """The plan, or None after a ProgramError; anything else fails the test."""
    try:
        return plan(source, limits)
    except ProgramError as exc:
        assert str(exc)  # a message, never empty
        return None


@FUZZ
@given(st.text(max_size=300))
def test_any_text_gives_a_plan_or_a_program_error(text: str) -> None:
    _plan_or_error(text)
    _plan_or_error(f"program p(a) {{\n{text}\n}}")  # past the header, into the statement rules


def _string() -> st.SearchStrategy[str]:
    return st.lists(WORDS, max_size=3).map(lambda words: '"' + " ".join(words) + '"')


def _literal() -> st.SearchStrategy[str]:
    scalar = st.one_of(
        _string(),
        st.integers(-(10**6), 10**6).map(str),
        st.sampled_from(["0.5", "1e999", "-0.0", "9" * 40, "2.5e-3"]),
    )
    return st.one_of(scalar, st.lists(scalar, max_size=3).map(lambda xs: "[" + ", ".join(xs) + "]"))


def _gen() -> st.SearchStrategy[str]:
    keys = st.sampled_from(["max_tokens", "stop", "temperature", "top_p", "seed", "type", "max_items", "bad"])
    kwargs = st.lists(st.tuples(keys, _literal()), max_size=3)
    return st.tuples(NAMES, kwargs).map(lambda t: f"{t[0]} = gen({', '.join(f'{k}={v}' for k, v in t[1])})")


def _cond() -> st.SearchStrategy[str]:
    plain = st.one_of(
        st.tuples(NAMES, _string()).map(lambda t: f"{t[0]} == {t[1]}"),
        st.tuples(NAMES, _string()).map(lambda t: f"contains({t[0]}, {t[1]})"),
    )
    return st.tuples(st.integers(0, 3), plain).map(lambda t: "not " * t[0] + t[1])


def _statements(depth: int) -> st.SearchStrategy[str]:
    simple = st.one_of(
        st.tuples(
            st.sampled_from(["system", "user", "assistant"]), st.one_of(_string(), NAMES.map("$".__add__))
        ).map(" ".join),
        _gen(),
        st.tuples(NAMES, st.lists(_string(), max_size=3)).map(
            lambda t: f"{t[0]} = select([{', '.join(t[1])}])"
        ),
        st.lists(NAMES, min_size=1, max_size=2).map(lambda ns: "wait " + ", ".join(ns)),
        st.lists(NAMES, min_size=1, max_size=2).map(lambda ns: "yield " + ", ".join(ns)),
        NAMES.map("kill ".__add__),
        NAMES.map("return ".__add__),
    )
    if depth == 0:
        return simple
    inner = st.lists(_statements(depth - 1), max_size=4).map("\n".join)
    nested = st.one_of(
        st.tuples(NAMES, inner).map(lambda t: f"{t[0]} = fork {{\n{t[1]}\n}}"),
        st.tuples(_cond(), inner).map(lambda t: f"if {t[0]} {{\n{t[1]}\n}}"),
        st.tuples(_cond(), inner, inner).map(lambda t: f"if {t[0]} {{\n{t[1]}\n}} else {{\n{t[2]}\n}}"),
    )
    return st.one_of(simple, nested)


PROGRAMS = st.tuples(st.lists(NAMES, max_size=2, unique=True), st.lists(_statements(3), max_size=8)).map(
    lambda t: f"program p({', '.join(t[0])}) {{\n" + "\n".join(t[1]) + "\n}"
)


def _fork_depth(body: list[Node]) -> int:
    deepest = 0
    for node in body:
        if isinstance(node, Fork):
            deepest = max(deepest, 1 + _fork_depth(node.body))
        elif isinstance(node, If):
            deepest = max(deepest, _fork_depth(node.then), _fork_depth(node.otherwise))
    return deepest


@FUZZ
@given(PROGRAMS)
def test_grammar_shaped_programs_plan_within_the_limits_or_fail_cleanly(source: str) -> None:
    checked = _plan_or_error(source)
    if checked is None:
        return
    assert len(source.encode()) <= LIMITS.max_source_bytes
    assert checked.calls <= LIMITS.max_calls
    assert checked.total_tokens <= LIMITS.max_total_tokens
    assert sum(op.sampling.max_tokens for op in checked.gens.values()) == checked.total_tokens
    assert _fork_depth(checked.syntax.body) <= LIMITS.max_fork_depth
    for op in checked.gens.values():
        assert 1 <= op.sampling.max_tokens <= LIMITS.max_total_tokens
        assert all(isinstance(stop, str) and stop for stop in op.sampling.stop)


@FUZZ
@given(PROGRAMS, st.integers(0, 200))
def test_a_program_cut_anywhere_fails_cleanly(source: str, cut: int) -> None:
    _plan_or_error(source[: len(source) * cut // 200])


def test_deep_nesting_is_a_program_error_not_a_recursion_error() -> None:
    for opener, closer in (('if a == "x" { ', "}"), ("h = fork { ", "}")):
        source = "program p(a) { " + opener * 3000 + closer * 3000 + " }"
        assert _plan_or_error(source, Limits()) is None
    negations = "program p(a) { if " + "not " * 10000 + 'a == "x" { } }'
    assert _plan_or_error(negations, Limits()) is not None  # long, but flat: accepted
