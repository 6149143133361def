"""The one decode loop: the same answers as re-decoding everything per token, in linear time."""

from __future__ import annotations

import random
from typing import Any

import pytest

from engine_adapter.runner.sampling import Sampling, cut_at_stop

pytestmark = pytest.mark.model
TEXTS = [
    "Héllo wörld 😀 ça va? 日本語のテキスト。\n\n- one\n- two\n3. three",
    "Question: what is 2 + 2?\nAnswer: 4.\n\nQuestion: and 3 + 3?\nAnswer: 6!",
    "emoji 👨\u200d👩\u200d👧 and ∑∫ symbols: éé!é!\n\nEND of text",
]


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    from engine_adapter.runner.model import load_model

    return load_model(quiet=True).tokenizer


class CountingTokenizer:
    """The real tokenizer, counting its decode calls and the tokens they decode."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer, self.calls, self.decoded_tokens = tokenizer, 0, 0

    def decode(self, ids: list[int], **kwargs: Any) -> str:
        self.calls += 1
        self.decoded_tokens += len(ids)
        return str(self.tokenizer.decode(ids, **kwargs))


def _reference(
    tokenizer: Any, ids: list[int], sampling: Sampling, eos: set[int]
) -> tuple[list[int], str, str]:
    """The former loop: decode the whole answer and search it for stop strings at every token."""
    tokens: list[int] = []
    for token in ids:
        if token in eos:
            return tokens, tokenizer.decode(tokens, skip_special_tokens=True), "stop"
        tokens.append(token)
        text, stopped = cut_at_stop(tokenizer.decode(tokens, skip_special_tokens=True), sampling.stop)
        if stopped:
            return tokens, text, "stop"
        if len(tokens) == sampling.max_tokens:
            break
    return tokens, tokenizer.decode(tokens, skip_special_tokens=True), "length"


def _incremental(
    tokenizer: Any, ids: list[int], sampling: Sampling, eos: set[int]
) -> tuple[list[int], str, str]:
    from engine_adapter.runner.decode import Completion

    answer = Completion(tokenizer, sampling, eos)
    for token in ids:
        if answer.add(token) is not None:
            break
    return answer.tokens, answer.text, answer.reason or "length"


def _samples(tokenizer: Any, count: int) -> list[list[int]]:
    """Real text cut anywhere, some tokens swapped for random ones (split characters, specials)."""
    rng, vocab = random.Random(7), len(tokenizer)
    samples = []
    for i in range(count):
        ids = tokenizer.encode(TEXTS[i % len(TEXTS)], add_special_tokens=False)
        ids = ids[rng.randrange(len(ids) // 2) :]
        samples.append([t if rng.random() > 0.15 else rng.randrange(vocab) for t in ids])
    return samples


def test_the_incremental_text_is_the_full_decode_at_every_token(tokenizer: Any) -> None:
    from engine_adapter.runner.decode import IncrementalText

    byte_pieces = [tokenizer.convert_tokens_to_ids(t) for t in ("Ã", "©", "ð", "Ł", "ĺ", "Ģ")]
    samples = [*_samples(tokenizer, 300), byte_pieces, [0, 1, 2, *byte_pieces, 2]]
    for ids in samples:
        text = IncrementalText(tokenizer)
        for k, token in enumerate(ids, 1):
            text.add(token)
            assert text.text == tokenizer.decode(ids[:k], skip_special_tokens=True), ids[:k]


@pytest.mark.parametrize(
    "stop",
    [("\n\n",), ("Answer:",), ("é!",), ("\n", "?"), ("😀",), ("nothing like this",), ("2 + 2", "Question")],
)
def test_same_answers_as_before_for_stops_across_token_boundaries(
    tokenizer: Any, stop: tuple[str, ...]
) -> None:
    eos = {tokenizer.convert_tokens_to_ids("<|im_end|>")}
    spanning = 0
    for ids in _samples(tokenizer, 120):
        for max_tokens in (3, 40):
            sampling = Sampling(max_tokens=max_tokens, stop=stop)
            expected = _reference(tokenizer, ids, sampling, eos)
            assert _incremental(tokenizer, ids, sampling, eos) == expected, (ids, stop)
            last = tokenizer.decode(expected[0][-1:], skip_special_tokens=True)
            spanning += expected[2] == "stop" and not any(s in last for s in stop)
    if stop not in (("nothing like this",), ("\n", "?")):  # (one-character stops fit in one token)
        assert spanning  # some stop strings really were split over several tokens


def test_an_end_token_ends_the_answer_without_being_kept(tokenizer: Any) -> None:
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    ids = [*tokenizer.encode("Paris is nice.", add_special_tokens=False), end, 42]
    assert _incremental(tokenizer, ids, Sampling(), {end}) == (ids[:-2], "Paris is nice.", "stop")


def test_decoding_is_linear_in_the_answer_length(tokenizer: Any) -> None:
    from engine_adapter.runner.decode import Completion

    ids = tokenizer.encode(" ".join(TEXTS) * 12, add_special_tokens=False)[:1500]
    counting = CountingTokenizer(tokenizer)
    answer = Completion(counting, Sampling(max_tokens=len(ids), stop=("never appears",)), set())
    for token in ids:
        answer.add(token)
    assert answer.reason == "length" and answer.text == tokenizer.decode(ids, skip_special_tokens=True)
    assert counting.calls <= 2 * len(ids)
    assert counting.decoded_tokens <= 8 * len(ids)  # each call decodes a window of a few tokens
