"""Chat turns as token ids, from the tokenizer's chat template (never hard-coded tokens).

A conversation built turn by turn (the DSL appends messages and answers one at a
time, and forks share what came before) gets the ids that `Engine.encode` gives the
whole conversation: each turn is the template's rendering of the conversation with
it, minus the rendering without it, tokenized.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvstore.errors import KVSieveError

Message = dict[str, str]


@dataclass
class Conversation:
    """The messages so far and their rendering by the chat template (a fork copies both)."""

    messages: list[Message] = field(default_factory=list)
    rendered: str = ""

    def copy(self) -> Conversation:
        """An independent copy (the strings are immutable; the list is not shared)."""
        return Conversation(list(self.messages), self.rendered)


@dataclass(frozen=True)
class Reply:
    """The ids around an answer: `opening` before it (the generation prompt), `closing` after."""

    opening: list[int]
    closing: list[int]


class ChatFormat:
    """Token ids of chat turns, as the tokenizer's chat template renders them."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._bare: tuple[str, str] | None = None

    def render(self, messages: Sequence[Message], add_generation_prompt: bool = False) -> str:
        """The template's text of a conversation."""
        return str(
            self._tokenizer.apply_chat_template(
                list(messages), tokenize=False, add_generation_prompt=add_generation_prompt
            )
        )

    def tokenize(self, text: str) -> list[int]:
        """Ids of rendered text (special tokens in it are already written out)."""
        return list(self._tokenizer.encode(text, add_special_tokens=False))

    def append(self, conversation: Conversation, role: str, content: str) -> list[int]:
        """Add a message to `conversation`; the ids that it adds."""
        message = {"role": role, "content": content}
        text = self.render([*conversation.messages, message])
        ids = self.tokenize(self._after(conversation.rendered, text))
        conversation.messages.append(message)
        conversation.rendered = text
        return ids

    def reply(self, conversation: Conversation) -> list[int]:
        """The ids that open the assistant's answer (the template's generation prompt).

        With no message yet (a program that generates before saying anything), templates
        refuse an empty conversation: the answer then opens with the bare generation
        prompt, as before the template was used, and stays outside the conversation.
        """
        if not conversation.messages:
            return self.tokenize(self._bare_turn()[0])
        text = self.render(conversation.messages, add_generation_prompt=True)
        return self.tokenize(self._after(conversation.rendered, text))

    def answered(self, conversation: Conversation, content: str) -> list[int]:
        """Record the assistant's answer `content`; the ids that close its turn after it."""
        if not conversation.messages:  # a bare answer (see `reply`): closed, not recorded
            return self.tokenize(self._bare_turn()[1])
        head = self.render(conversation.messages, add_generation_prompt=True)
        message = {"role": "assistant", "content": content}
        text = self.render([*conversation.messages, message])
        closing = self._after(head + content, text)
        conversation.messages.append(message)
        conversation.rendered = text
        return self.tokenize(closing)

    def _bare_turn(self) -> tuple[str, str]:
        """(generation prompt, end of an answer's turn), read off a one-message conversation."""
        if self._bare is None:
            user = {"role": "user", "content": "?"}
            asked = self.render([user])
            opening = self._after(asked, self.render([user], add_generation_prompt=True))
            answered = self.render([user, {"role": "assistant", "content": "!"}])
            self._bare = (opening, self._after(asked + opening + "!", answered))
        return self._bare

    def _after(self, head: str, text: str) -> str:
        if not text.startswith(head):
            raise KVSieveError(
                "the tokenizer's chat template does not render a conversation turn by turn "
                "(an added message changes the text before it)"
            )
        return text[len(head) :]
