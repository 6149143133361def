"""Real text that nobody here wrote, for benchmarks on the real model.

The license texts Debian ships in /usr/share/common-licenses (GPL, LGPL, MPL,
GFDL, Apache, Artistic): long, varied English prose that every Debian machine has.
"""

from __future__ import annotations

from pathlib import Path

LICENSE_DIR = Path("/usr/share/common-licenses")
DOCUMENTS = (
    "GPL-3", "GPL-2", "LGPL-2.1", "LGPL-2", "MPL-1.1", "GFDL-1.3", "GFDL-1.2", "MPL-2.0",
    "GPL-1", "Apache-2.0", "LGPL-3", "Artistic", "CC0-1.0",
)  # fmt: skip
QUESTION = "\n\nQuestion: in one short sentence, what does the text above allow a reader to do?"


def documents() -> list[tuple[str, str]]:
    """(name, text) of every available document, longest first."""
    found = [(name, (LICENSE_DIR / name).read_text(errors="replace")) for name in DOCUMENTS]
    found = [(n, t) for n, t in found if t]
    if not found:
        raise FileNotFoundError(f"no license texts under {LICENSE_DIR}; install the base-files package")
    return sorted(found, key=lambda nt: -len(nt[1]))


def token_windows(
    tokenizer: object, num_tokens: int, count: int, tail: int = 0
) -> list[tuple[str, list[int]]]:
    """`count` windows of `num_tokens` (+ `tail` following) tokens, one per document where possible."""
    encode = tokenizer.encode  # type: ignore[attr-defined]
    out = []
    docs = documents()
    for name, text in docs:
        ids = encode(text)
        if len(ids) >= num_tokens + tail:
            out.append((name, ids[: num_tokens + tail]))
        if len(out) == count:
            return out
    for name, text in docs:  # not enough long documents: take later windows of the longest ones
        ids = encode(text)
        for start in range(num_tokens // 2, len(ids) - num_tokens - tail, num_tokens):
            out.append((f"{name}@{start}", ids[start : start + num_tokens + tail]))
            if len(out) == count:
                return out
    return out


def stream_windows(tokenizer: object, num_tokens: int, count: int) -> list[list[int]]:
    """`count` windows of `num_tokens` tokens from all the texts joined into one stream, spread
    over it: long documents (8k tokens) that no single license text is. A window may span two
    texts, as a long document of several sections does."""
    encode = tokenizer.encode  # type: ignore[attr-defined]
    stream: list[int] = []
    for _, text in documents():
        stream += encode(text + "\n\n")
    if len(stream) < num_tokens:
        raise RuntimeError(f"the texts hold {len(stream)} tokens, fewer than one window of {num_tokens}")
    last = len(stream) - num_tokens
    starts = [last * i // max(count - 1, 1) for i in range(count)]
    return [stream[s : s + num_tokens] for s in starts]
