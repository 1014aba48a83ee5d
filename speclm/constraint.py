"""Constrained decoding: the output follows a JSON schema, a regular expression or a grammar.

A `Constraint` is what a request asks for (OpenAI's `response_format`, speclm's `regex` and
`grammar`); a `Matcher` is one request's parser over the target's tokens (llguidance, which
compiles the constraint to a token mask per position: docs/constraints.md says why this library).

The constrained distribution is the target's: at every position the target's logits of the
tokens the constraint forbids are set to -inf before temperature, top-k and top-p (plain decoding
and every method alike), so greedy output is constrained plain decoding's, token for token, and
sampled output follows the constrained target distribution exactly. With speculation
(speclm.round.batch) the matcher walks each row's draft tree: each node's mask is the state
after its path (consume, mask, roll back: the matcher ends a round where it began, then
consumes what the round commits). A drafted token the constraint forbids ends its branch there:
- its descendants are dropped (they cannot be accepted: their parent is rejected);
- the token itself is dropped where that changes no draw: greedy and seeded rows (they take the
  target's own token at each position) and one-hot drafts (a point mass on a forbidden token is
  rejected with probability 1 and leaves the target's distribution whole). A token a draft
  *sampled* stays as a leaf: the verifier rejects it (the target gives it probability 0) and
  draws from the residual max(0, p - q), which is what keeps sampling exact (dropping it would
  draw from p instead and over-weight the tokens the draft favours).
"""

from __future__ import annotations

import functools
import json
import time
from dataclasses import dataclass

import torch

from speclm.errors import UsageError
from speclm.tree import PAD, ROOT

KINDS = ("json_object", "json_schema", "regex", "grammar")
# JSON's whitespace between tokens: runs of at most 16 spaces, newlines, tabs or returns, so that
# pretty-printing fits and no model can loop on whitespace (an unbounded run lets one)
JSON_OPTIONS = {"whitespace_pattern": r"[\x20\x0A\x0D\x09]{0,16}"}


@dataclass(frozen=True)
class Constraint:
    """kind: "json_object" (any JSON object), "json_schema" (source: the schema, JSON text), "regex"
    (source: a regular expression the whole output matches) or "grammar" (source: a Lark grammar,
    llguidance's dialect, or llama.cpp's GBNF, told apart by llguidance)."""

    kind: str
    source: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise UsageError(f"unknown constraint '{self.kind}' (choose from {', '.join(KINDS)})")
        error = _llguidance().LLMatcher.validate_grammar(self.grammar)
        if error:
            raise UsageError(f"{self.kind.replace('_', ' ')}: {_first_line(error)}")

    @functools.cached_property  # made once: checked at construction, then each request's parser reads it
    def grammar(self) -> str:
        """The constraint as llguidance takes it."""
        llg = _llguidance()
        if self.kind == "json_object":
            return llg.LLMatcher.grammar_from_json_schema({"type": "object"}, JSON_OPTIONS)
        if self.kind == "json_schema":
            try:
                schema = json.loads(self.source)
            except json.JSONDecodeError as e:
                raise UsageError(f"json schema: not JSON ({e.msg} at line {e.lineno} column {e.colno})") from None
            if not isinstance(schema, (dict, bool)):
                raise UsageError("json schema: a JSON object (or true/false)")
            try:
                return llg.LLMatcher.grammar_from_json_schema(schema, JSON_OPTIONS)
            except Exception as e:  # llguidance says what in the schema it does not take
                raise UsageError(f"json schema: {_first_line(str(e))}") from None
        if self.kind == "regex":
            return llg.LLMatcher.grammar_from_regex(self.source)
        from llguidance.gbnf_to_lark import any_to_lark

        try:
            return llg.LLMatcher.grammar_from_lark(any_to_lark(self.source))  # GBNF is converted to Lark
        except Exception as e:
            raise UsageError(f"grammar: {_first_line(str(e))}") from None

    @staticmethod
    def of(response_format=None, regex: str | None = None, grammar: str | None = None) -> "Constraint | None":
        """From OpenAI's `response_format` ({"type": "text" | "json_object" | "json_schema",
        "json_schema": {"schema": {...}, ...}}) and speclm's `regex` / `grammar`: at most one."""
        given = [name for name, v in (("response_format", _constraining(response_format)), ("regex", regex),
                                      ("grammar", grammar)) if v]
        if len(given) > 1:
            raise UsageError(f"one constraint per request: {' and '.join(given)} were both given")
        if regex is not None:
            return Constraint("regex", _text("regex", regex))
        if grammar is not None:
            return Constraint("grammar", _text("grammar", grammar))
        if response_format is None or isinstance(response_format, Constraint):
            return response_format
        if not isinstance(response_format, dict) or not isinstance(response_format.get("type"), str):
            raise UsageError('response_format: an object with a "type" (text, json_object or json_schema)')
        kind = response_format["type"]
        if kind == "text":
            return None
        if kind == "json_object":
            return Constraint("json_object")
        if kind != "json_schema":
            raise UsageError(f"response_format.type: text, json_object or json_schema, not '{kind}'")
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec:
            raise UsageError('response_format.json_schema: an object with a "schema"')
        return Constraint("json_schema", json.dumps(spec["schema"]))


def _constraining(response_format) -> bool:
    return response_format is not None and not (isinstance(response_format, dict) and response_format.get("type") == "text")


def _text(name: str, value) -> str:
    if not isinstance(value, str) or not value:
        raise UsageError(f"{name}: a non-empty string")
    return value


def _first_line(message: str) -> str:
    """An error of the library's as one line (a server's 400, the CLI's one line)."""
    line = " ".join(part.strip() for part in message.strip().splitlines() if part.strip()) or "invalid"
    return line if len(line) <= 240 else line[:237] + "..."


def _llguidance():
    import llguidance

    return llguidance


def tokenizer_for(tokenizer, vocab: int, eos: tuple[int, ...]):
    """llguidance's view of a transformers fast tokenizer over `vocab` logits (ids past the
    tokenizer's own are never allowed), with the target's end-of-sequence ids. Slow (about a second
    for a 150k vocabulary): an engine makes it once."""
    import llguidance.hf

    try:
        # its width: the logits' or the tokenizer's, the larger (ids past the logits are never drawn)
        return llguidance.hf.from_tokenizer(tokenizer, n_vocab=max(vocab, len(tokenizer)), eos_token=list(eos) or None)
    except Exception as e:  # a slow tokenizer, or a decoder llguidance does not read
        raise UsageError(f"constrained decoding needs a byte-level fast tokenizer: {_first_line(str(e))}") from None


def unpack(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """(M, W) int32 bitmasks (bit t % 32 of word t // 32: token t allowed) -> (M, vocab) bool."""
    bits = (bitmask.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1  # (M, W, 32)
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab].bool()


def forbid(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """logits (M, V) in place: -inf where bitmask (M, W) forbids the token."""
    with torch.inference_mode():  # the forward's logits are inference tensors
        logits.masked_fill_(~unpack(bitmask, logits.shape[-1]).to(logits.device), float("-inf"))


class Matcher:
    """One request's parser: its state is the request's committed tokens. `masks` walks a draft
    tree from there and returns to it; `commit` moves it on."""

    def __init__(self, constraint: Constraint, tokenizer, eos: tuple[int, ...] = ()):
        """tokenizer: `tokenizer_for`'s; eos: the ids that end a request (an allowed one is never
        consumed: the request ends there)."""
        llg = _llguidance()
        self.constraint, self.eos = constraint, frozenset(eos)
        self._m = llg.LLMatcher(tokenizer, constraint.grammar, log_level=0)
        self._words = (tokenizer.vocab_size + 31) // 32
        self.mask_seconds = 0.0  # spent computing masks (the constraint's share of a request's time)
        self._check()

    def _check(self) -> None:
        if self._m.is_error():
            raise UsageError(f"constraint: {_first_line(self._m.get_error())}")

    def _fill(self, out: torch.Tensor, row: int) -> None:
        v = out[row]
        self._m.unsafe_compute_mask_ptr(v.data_ptr(), v.numel() * v.element_size())

    @staticmethod
    def allows(bitmask_row: torch.Tensor, token: int) -> bool:
        return bool((int(bitmask_row[token >> 5]) >> (token & 31)) & 1)

    def mask(self) -> torch.Tensor:
        """(1, W) int32: the tokens allowed next."""
        t0 = time.perf_counter()
        out = torch.zeros(1, self._words, dtype=torch.int32)
        self._fill(out, 0)
        self.mask_seconds += time.perf_counter() - t0
        return out

    def masks(self, tokens: list[int], parents: list[int]) -> tuple[torch.Tensor, list[int], list[int]]:
        """A draft tree's row (speclm.tree: tokens and parents, PAD for padding): (1 + N, W) int32
        bitmasks, at the root (0) and after each node's path (1 + n); the nodes the constraint
        forbids, and the allowed end-of-sequence nodes, in node order. Either ends its branch:
        below it nothing is walked (its rows of masks allow everything: nothing reads them). The
        matcher's state is unchanged."""
        t0 = time.perf_counter()
        out = torch.full((1 + len(tokens), self._words), -1, dtype=torch.int32)
        children: dict[int, list[int]] = {}
        for n, parent in enumerate(parents):
            if parent != PAD:
                children.setdefault(parent, []).append(n)
        forbidden: list[int] = []
        ends: list[int] = []
        self._fill(out, 0)
        stack = [(ROOT, iter(children.get(ROOT, ())))]  # a depth-first walk: one consume and roll back per node
        while stack:
            node, todo = stack[-1]
            child = next(todo, None)
            if child is None:
                stack.pop()
                if node != ROOT:
                    self._m.rollback(1)
                continue
            if not self.allows(out[1 + node], tokens[child]):
                forbidden.append(child)
                continue
            if tokens[child] in self.eos:
                ends.append(child)
                continue
            if not self._m.consume_token(tokens[child]):
                forbidden.append(child)
                continue
            self._fill(out, 1 + child)
            stack.append((child, iter(children.get(child, ()))))
        self.mask_seconds += time.perf_counter() - t0
        return out, sorted(forbidden), sorted(ends)

    def allowed(self, width: int, columns: torch.Tensor | None = None) -> torch.Tensor:
        """(width,) bool: the tokens allowed next, by id (ids past the parser's vocabulary: False);
        given columns (S,), the token ids of a restricted head's columns: (S,) over those."""
        out = unpack(self.mask(), self._words * 32)[0]
        if columns is not None:
            return out[columns]
        return torch.cat([out, out.new_zeros(width - len(out))]) if len(out) < width else out[:width]

    def push(self, token: int) -> bool:
        """A drafter's token, consumed for its next mask (False: not taken: an end of sequence, or
        forbidden); `pop` takes pushed tokens back."""
        # checked first: consuming a forbidden token would leave the parser in its error state
        return token not in self.eos and self._m.validate_tokens([token]) == 1 and self._m.consume_token(token)

    def pop(self, count: int) -> None:
        if count:
            self._m.rollback(count)

    def commit(self, tokens: list[int]) -> None:
        """The request committed these tokens (each allowed by its mask; an end of sequence ends them)."""
        tokens = next((tokens[:i] for i, t in enumerate(tokens) if t in self.eos), tokens)
        if tokens and not self._m.consume_tokens(tokens):
            self._check()
            raise RuntimeError("a committed token broke the constraint")  # the masks make this unreachable

    @property
    def done(self) -> bool:
        """The constraint is complete and takes no more tokens (only an end of sequence)."""
        return self._m.is_stopped()
