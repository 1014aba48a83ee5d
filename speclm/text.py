"""Turning committed token ids into text: stop strings and streaming deltas."""

from __future__ import annotations


def find_stop(text: str, stops: tuple[str, ...]) -> int:
    """Index where the earliest stop string starts in text, or -1."""
    hits = [i for i in (text.find(s) for s in stops if s) if i >= 0]
    return min(hits) if hits else -1


def stop_cut(tokenizer, token_ids: list[int], first_new: int, stops: tuple[str, ...]) -> int | None:
    """If a stop string appears in the decoded text, the number of tokens up to and including
    the one that completes it (tokens from first_new on are new this step); else None."""
    if not stops or find_stop(tokenizer.decode(token_ids, skip_special_tokens=True), stops) < 0:
        return None
    for end in range(max(first_new, 1), len(token_ids) + 1):
        if find_stop(tokenizer.decode(token_ids[:end], skip_special_tokens=True), stops) >= 0:
            return end
    return len(token_ids)


def final_text(tokenizer, token_ids: list[int], stops: tuple[str, ...]) -> str:
    text = tokenizer.decode(token_ids, skip_special_tokens=True)
    cut = find_stop(text, stops)
    return text[:cut] if cut >= 0 else text


class IncrementalText:
    """Text deltas from a growing list of token ids.

    Decodes the whole generated sequence each time (tokenizers merge bytes across tokens,
    so a character may need several tokens) and holds back a trailing replacement character
    (an incomplete UTF-8 sequence) and any tail that could still become a stop string.
    """

    def __init__(self, tokenizer, stops: tuple[str, ...] = ()):
        self.tokenizer, self.stops = tokenizer, tuple(s for s in stops if s)
        self.emitted = 0  # characters already returned

    def delta(self, token_ids: list[int], finished: bool) -> str:
        text = final_text(self.tokenizer, token_ids, self.stops)
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
