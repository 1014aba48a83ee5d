"""Turning committed token ids into text: stop strings and streaming deltas."""

from __future__ import annotations


def tokenizer_fingerprint(tokenizer) -> str:
    """A short hash of the tokenizer's vocabulary (token -> id, special tokens included): two models
    whose token ids mean the same text have the same one (a remote draft and its verifier)."""
    import hashlib
    import json

    cached = getattr(tokenizer, "_speclm_fingerprint", None)
    if cached is None:
        vocab = sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])
        cached = hashlib.sha256(json.dumps(vocab, ensure_ascii=False).encode()).hexdigest()[:16]
        try:
            tokenizer._speclm_fingerprint = cached
        except AttributeError:
            pass
    return cached


def find_stop(text: str, stops: tuple[str, ...]) -> int:
    """Index where the earliest stop string starts in text, or -1."""
    hits = [i for i in (text.find(s) for s in stops if s) if i >= 0]
    return min(hits) if hits else -1


def stop_cut(tokenizer, token_ids: list[int], first_new: int, stops: tuple[str, ...]) -> int | None:
    """If a stop string appears in the decoded text, the number of tokens up to and including
    the one that completes it (tokens from first_new on are new this step); else None.

    Only the new tokens and those before them that a stop string could still span are decoded
    (a character is at most 4 byte tokens), so a step costs its own tokens, not the whole answer.
    The text before first_new held no stop string (the request would have stopped)."""
    stops = tuple(s for s in stops if s)
    if not stops:
        return None
    start = max(0, first_new - 4 * max(map(len, stops)) - 4)

    def has_stop(end: int) -> bool:
        return find_stop(tokenizer.decode(token_ids[start:end], skip_special_tokens=True), stops) >= 0

    if not has_stop(len(token_ids)):
        return None
    for end in range(max(first_new, 1), len(token_ids) + 1):
        if has_stop(end):
            return end
    return len(token_ids)


def cut_at_stop(text: str, stops: tuple[str, ...]) -> str:
    """text up to the earliest stop string, or all of it."""
    cut = find_stop(text, stops)
    return text[:cut] if cut >= 0 else text


def final_text(tokenizer, token_ids: list[int], stops: tuple[str, ...]) -> str:
    return cut_at_stop(tokenizer.decode(token_ids, skip_special_tokens=True), stops)


class IncrementalText:
    """Text deltas from a growing list of token ids.

    Each call decodes a window, not the whole sequence: the tokens read since the last call,
    after those of the call before (tokenizers merge bytes across tokens, and some drop a space
    at the start of a decode, so only what the window adds past its first tokens counts). A
    trailing replacement character (an incomplete UTF-8 sequence) waits for its next bytes, and
    a tail that could still become a stop string is held back. The last call decodes the whole
    sequence, so the deltas always join to the final text.
    """

    def __init__(self, tokenizer, stops: tuple[str, ...] = ()):
        self.tokenizer, self.stops = tokenizer, tuple(s for s in stops if s)
        self.emitted = 0  # characters already returned
        self._settled = ""  # the text of token_ids[:_read]
        self._prefix = self._read = 0  # the window: token_ids[_prefix:], its first _read - _prefix tokens settled

    def delta(self, token_ids: list[int], finished: bool) -> str:
        whole = self.tokenizer.decode(token_ids, skip_special_tokens=True) if finished else self._text(token_ids)
        text = cut_at_stop(whole, self.stops)
        end = len(text)
        if not finished:
            while end > self.emitted and text[end - 1] == "\ufffd":
                end -= 1
            end -= self._possible_stop_prefix(text[:end])
        if end <= self.emitted:
            return ""
        out = text[self.emitted : end]
        self.emitted = end
        return out

    def _text(self, token_ids: list[int]) -> str:
        decode = self.tokenizer.decode
        settled = decode(token_ids[self._prefix : self._read], skip_special_tokens=True)
        window = decode(token_ids[self._prefix :], skip_special_tokens=True)
        if not window.startswith(settled):  # not a concatenation at this split: the whole text
            return decode(token_ids, skip_special_tokens=True)
        new = window[len(settled) :]
        if new.endswith("\ufffd"):  # a character still incomplete: the window grows until it is whole
            return self._settled + new
        self._settled += new
        self._prefix, self._read = self._read, len(token_ids)
        return self._settled

    def _possible_stop_prefix(self, text: str) -> int:
        longest = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(text)), longest, -1):
                if s.startswith(text[-n:]):
                    longest = n
                    break
        return longest


def chat_ids(tokenizer, text: str) -> list[int]:
    """A prompt as a chat model reads it: one user message in its chat template, then the
    assistant's turn opened."""
    chat = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True)
    return list(tokenizer(chat, add_special_tokens=False).input_ids)


def byte_level_table() -> dict[str, int]:
    """Byte-level BPE's printable stand-in for each byte (GPT-2's scheme), character -> byte:
    printable Latin-1 bytes stand for themselves, the others for 256, 257, ... in byte order."""
    kept = {*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)}
    table, extra = {}, 0
    for b in range(256):
        if b in kept:
            table[chr(b)] = b
        else:
            table[chr(256 + extra)] = b
            extra += 1
    return table


_BYTE_LEVEL = byte_level_table()


def token_pieces(tokenizer, token_ids: list[int]) -> list[tuple[str, bytes]]:
    """Each token's own text and bytes (OpenAI's logprobs `token` and `bytes`): a byte-level BPE
    token's bytes exactly (a piece of a character decodes with U+FFFD in its text), otherwise the
    UTF-8 of its decoded text."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    byte_level = backend is not None and type(backend.decoder).__name__ == "ByteLevel"
    out = []
    for t, piece in zip(token_ids, tokenizer.convert_ids_to_tokens(list(token_ids))):
        if byte_level and piece is not None and all(c in _BYTE_LEVEL for c in piece):
            raw = bytes(_BYTE_LEVEL[c] for c in piece)
            out.append((raw.decode("utf-8", "replace"), raw))
        else:
            text = tokenizer.decode([t])
            out.append((text, text.encode()))
    return out
