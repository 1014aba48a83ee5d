"""IncrementalText: deltas decoded from a window join to the whole decode, for tokenizers that
merge bytes across tokens, join words with spaces, or drop a space at the start of a decode."""

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from speclm.text import IncrementalText
from tiny import byte_tokenizer, word_tokenizer


def metaspace_tokenizer() -> PreTrainedTokenizerFast:
    """SentencePiece-like: pieces carry a leading '▁' that decodes to a space, except at the start."""
    pieces = ["▁the", "▁cat", "▁sat", "s", "ing", "▁é", "!", "<eos>"]
    tok = Tokenizer(models.WordLevel(vocab={p: i for i, p in enumerate(pieces)}, unk_token="!"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")


TOKENIZERS = {"bytes": byte_tokenizer(), "words": word_tokenizer(12), "metaspace": metaspace_tokenizer()}
WORDS = ["héllo", "wörld", "€", "😀", "abc", " ", "\n", "日本語", "x"]


def streamed(tok, ids: list[int], cuts: list[int]) -> list[str]:
    """The deltas of ids committed in steps ending at `cuts` (then the rest, finished)."""
    inc = IncrementalText(tok)
    ends = sorted({c for c in cuts if 0 < c < len(ids)}) + [len(ids)]
    return [inc.delta(ids[:end], finished=end == len(ids)) for end in ends]


@settings(max_examples=150, deadline=None)
@given(kind=st.sampled_from(sorted(TOKENIZERS)), seed=st.integers(0, 2**32 - 1),
       length=st.integers(1, 60), cuts=st.lists(st.integers(0, 60), max_size=30))
def test_deltas_join_to_the_whole_decode(kind, seed, length, cuts):
    tok = TOKENIZERS[kind]
    rng = random.Random(seed)
    if kind == "bytes":  # valid UTF-8 text, its characters spanning 1-4 byte tokens
        ids = tok("".join(rng.choice(WORDS) for _ in range(length))).input_ids
    else:
        ids = [rng.randrange(len(tok) - 1) for _ in range(length)]
    deltas = streamed(tok, ids, cuts)
    assert "".join(deltas) == tok.decode(ids, skip_special_tokens=True)
    assert not any("\ufffd" in d for d in deltas)


def test_each_step_decodes_a_window_not_the_whole_text():
    """The point of the window: a long answer costs each step its own tokens, not all before them."""
    tok = TOKENIZERS["bytes"]
    ids = tok("abc " * 500).input_ids
    lengths = []

    class Counting:
        def decode(self, token_ids, **kw):
            lengths.append(len(token_ids))
            return tok.decode(token_ids, **kw)

    inc = IncrementalText(Counting())
    for end in range(1, len(ids)):
        inc.delta(ids[:end], finished=False)
    assert max(lengths) <= 2


@pytest.mark.parametrize("stops", [("cat sat",), ("sat", "the")])
def test_stop_strings_cut_and_hold_back_with_windows(stops):
    tok = TOKENIZERS["metaspace"]
    ids = tok("the cat the cat sat sing").input_ids
    inc = IncrementalText(tok, stops)
    text = "".join(inc.delta(ids[: i + 1], finished=False) for i in range(len(ids)))
    whole = tok.decode(ids, skip_special_tokens=True)
    assert text == whole[: min(whole.find(s) for s in stops if s in whole)]


def whole_text_stop_cut(tok, ids: list[int], first_new: int, stops: tuple[str, ...]) -> int | None:
    """The reference: decode everything at every length."""
    def has(end):
        return any(s in tok.decode(ids[:end], skip_special_tokens=True) for s in stops if s)
    if not has(len(ids)):
        return None
    return next(end for end in range(max(first_new, 1), len(ids) + 1) if has(end))


@settings(max_examples=150, deadline=None)
@given(kind=st.sampled_from(sorted(TOKENIZERS)), seed=st.integers(0, 2**32 - 1),
       length=st.integers(1, 50), steps=st.lists(st.integers(1, 6), min_size=1, max_size=30))
def test_stop_cut_reads_a_window_and_cuts_where_the_whole_text_does(kind, seed, length, steps):
    """Tokens committed a few per step, as a batch commits them: the windowed stop_cut stops at
    the same token as decoding the whole answer at every step would."""
    from speclm.text import stop_cut

    tok = TOKENIZERS[kind]
    rng = random.Random(seed)
    if kind == "bytes":
        ids = tok("".join(rng.choice(WORDS) for _ in range(length))).input_ids
    else:
        ids = [rng.randrange(len(tok) - 1) for _ in range(length)]
    whole = tok.decode(ids, skip_special_tokens=True)
    a = rng.randrange(len(whole) + 1)
    stops = (whole[a : a + rng.randint(1, 6)] or "x", "never-there")  # often present, sometimes not
    done, got, want = 0, None, None
    for n in steps + [len(ids)]:
        end = min(len(ids), done + n)
        got = stop_cut(tok, ids[:end], done, stops)
        want = whole_text_stop_cut(tok, ids[:end], done, stops)
        assert got == want
        if got is not None or end == len(ids):
            break
        done = end
