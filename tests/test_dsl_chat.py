"""The DSL's chat turns come from the tokenizer's chat template: the ids Engine.encode gives."""

from __future__ import annotations

from typing import Any

import pytest

from engine_adapter.dsl import plan
from engine_adapter.dsl.run import ProgramRun
from engine_adapter.runner.chat import Conversation

pytestmark = pytest.mark.model
SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


@pytest.fixture(scope="module")
def engine() -> Any:
    from engine_adapter.runner.engine import Engine
    from engine_adapter.runner.model import load_model

    return Engine(load_model(quiet=True), None)


def _prompt(engine: Any, body: str, args: dict[str, str]) -> tuple[list[int], list[Any]]:
    """The main branch's computed tokens when `body` yields its last value, and all its events."""
    params = ", ".join(args)
    run = ProgramRun(engine, plan(f"program p({params}) {{\n{body}\n}}"), args)
    events, tokens = [], []
    for event in run.events():
        if event.kind == "yield":  # the run still holds its contexts (they are dropped at its end)
            tokens = list(run._branches[0].ctx.tokens)
        events.append(event)
    assert events[-1].kind == "done", events[-1]
    return tokens, events


def _old_format(engine: Any, text: str) -> list[int]:
    """The executor's former hard-coded SmolLM2 formatting, for comparison."""
    return list(engine.lm.tokenizer.encode(text, add_special_tokens=False))


def test_a_user_turn_has_the_ids_engine_encode_gives(engine: Any) -> None:
    body = f'  system "{SYSTEM}"\n  user "What is {{x}}?"\n  a = gen(max_tokens=1)\n  yield a'
    tokens, _ = _prompt(engine, body, {"x": "the capital of France"})
    messages = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "What is the capital of France?"},
    ]
    assert tokens == engine.encode(messages)
    before = f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\nWhat is the capital of France?"
    assert tokens == _old_format(engine, before + "<|im_end|>\n<|im_start|>assistant\n")  # as before


def test_a_second_turn_follows_the_answer_as_before(engine: Any) -> None:
    body = f'  system "{SYSTEM}"\n  user "Hi"\n  a = gen(max_tokens=3)\n'
    body += '  user "Bye"\n  b = gen(max_tokens=1)\n  yield b'
    tokens, _ = _prompt(engine, body, {})
    first = _old_format(
        engine,
        f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n",
    )
    end = _old_format(engine, "<|im_end|>\n")
    second = _old_format(engine, "<|im_start|>user\nBye<|im_end|>\n<|im_start|>assistant\n")
    answer = tokens[len(first) : len(tokens) - len(end) - len(second)]
    assert tokens == first + answer + end + second and 1 <= len(answer) <= 3


def test_a_program_without_a_system_message_gets_the_templates_default(engine: Any) -> None:
    tokens, _ = _prompt(engine, '  user "Hi"\n  a = gen(max_tokens=1)\n  yield a', {})
    assert tokens == engine.encode("Hi")  # what `kvsieve generate "Hi"` computes too
    assert engine.lm.tokenizer.decode(tokens).startswith(f"<|im_start|>system\n{SYSTEM}")


def test_fork_branches_continue_the_same_conversation(engine: Any) -> None:
    body = (
        f'  system "{SYSTEM}"\n  user "Hi"\n'
        '  h = fork { user "Say yes." v = select(["yes", "no"]) return v }\n  wait h\n  yield h'
    )
    _, events = _prompt(engine, body, {})
    assert [e.kind for e in events] == ["yield", "done"] and events[0].value in ("yes", "no")


def test_an_answer_before_any_message_opens_and_closes_as_before(engine: Any) -> None:
    """Templates refuse an empty conversation; a bare answer keeps the old turn markers."""
    conversation = Conversation()
    assert engine.chat.reply(conversation) == _old_format(engine, "<|im_start|>assistant\n")
    assert engine.chat.answered(conversation, "x") == _old_format(engine, "<|im_end|>\n")
    assert conversation.messages == []  # a bare answer is not a message of the conversation
