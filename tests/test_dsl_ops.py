"""The planner emits typed operations with resolved slots; the executor runs those, not syntax."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from engine_adapter.dsl import ops, plan

ROOT = Path(__file__).resolve().parent.parent


def test_the_chatbot_lowers_to_typed_operations() -> None:
    checked = plan((ROOT / "examples" / "chatbot.kvs").read_text())
    kinds = [type(op) for op in checked.body]
    assert kinds[:4] == [ops.Say, ops.Say, ops.Gen, ops.Yield] and ops.Fork in kinds
    gen = checked.body[2]
    assert isinstance(gen, ops.Gen) and gen.sampling.stop == ("\n\n",) and gen.sampling.max_tokens == 128
    question = checked.params[0]
    user = checked.body[1]
    assert isinstance(user, ops.Say) and user.text.parts == (question,)
    follow = next(op for op in checked.body if isinstance(op, ops.Fork) and op.target.name == "follow")
    listing = follow.body[1]
    assert isinstance(listing, ops.Gen) and listing.as_list and listing.max_items == 3


def test_a_fork_gets_its_own_frame_with_only_what_it_may_read() -> None:
    source = """program p(q) {
      a = gen(max_tokens=2)
      h = fork { user "{a} and {q}" x = gen(max_tokens=2) return x }
      k = fork { h2 = fork { y = gen(max_tokens=2) return y } wait h2 return h2 }
      wait h
      z = fork { user "{h}" w = gen(max_tokens=2) return w }
    }"""
    checked = plan(source)
    h, k, z = (op for op in checked.body if isinstance(op, ops.Fork))
    slots = {s.name: s.index for op in checked.body if isinstance(op, ops.Gen) for s in [op.target]}
    slots |= {"q": checked.params[0].index, "h": h.target.index}
    # h reads a and q (copied in); it cannot see handles; its x lives in its own frame.
    assert sorted(parent for parent, _ in h.captures) == sorted([slots["a"], slots["q"]])
    assert h.frame_size == 3 and len({h.target.index, k.target.index, z.target.index}) == 3
    say = h.body[0]
    assert isinstance(say, ops.Say)
    child_of = dict(h.captures)
    assert [p.index for p in say.text.parts if isinstance(p, ops.Slot)] == [
        child_of[slots["a"]],
        child_of[slots["q"]],
    ]
    # a waited handle is readable in a later fork, as a value
    assert slots["h"] in {parent for parent, _ in z.captures}
    assert checked.frame_size == 5  # q, a, h, k, z: the forks' own names live in their frames


def test_the_executor_knows_no_syntax_and_no_chat_tokens() -> None:
    source = (ROOT / "engine_adapter" / "dsl" / "run.py").read_text()
    assert "dsl.syntax" not in source and "import syntax" not in source
    assert "<|im_start|>" not in source and "<|im_end|>" not in source
    assert "isinstance(op" not in source  # it matches on operation types


def test_planning_imports_no_torch() -> None:
    code = (
        "import sys, engine_adapter.dsl.plan, engine_adapter.runner.sampling; print('torch' in sys.modules)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"
