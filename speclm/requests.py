"""One request as the engine runs it: its ids, its options, its own random generator, its stats."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from speclm.options import GenerationOptions

if TYPE_CHECKING:
    from speclm.constraint import Matcher
from speclm.sampling import Coupled
from speclm.stats import RequestStats


@dataclass(frozen=True)
class TokenLogprob:
    """A generated token's log-probability under the target's distribution where it was committed,
    and the most likely tokens there (GenerationOptions.logprobs)."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token, log-probability), most likely first


@dataclass
class Given:
    """A draft that came with a request (remote verification: speclm.serve.remote): the last
    len(tokens) tokens of its prompt. The request's prefill forward scores them as a round's would,
    the one verifier decides, the request commits the accepted ones and one token of the target's
    and ends ("verified" where its length and stops did not end it first)."""

    tokens: list[int]
    probs: torch.Tensor | None = None  # (K, V): the distribution each token was drawn from (sampling); None: one-hot


@dataclass(eq=False)  # compared by identity: two requests are never the same one
class Request:
    index: int  # the caller's number for it (generate: its position in the prompt list)
    context: list[int]  # prompt + generated ids
    prompt_len: int
    max_new: int  # max_new_tokens, cut to what the model's context leaves
    options: GenerationOptions
    # its own draws (sampling), seeded by the caller; None: greedy. Never a batch-wide draw, so a
    # request's output does not depend on which others share its batch.
    generator: torch.Generator | None
    stats: RequestStats = field(default_factory=RequestStats)
    finish_reason: str | None = None  # "stop" (EOS or a stop string), "length" or "cancelled"; None while it runs
    joined_at: float = 0.0  # time.perf_counter() when its prefill began
    # the caller chose its seed (sampling): every token drawn by position from it (speclm.sampling.Coupled),
    # so its text is its plain decoding's with that seed, whatever the method, plan or batch
    coupled: Coupled | None = None
    # its constraint's parser (speclm.constraint.Matcher), at its committed tokens; None: unconstrained
    matcher: "Matcher | None" = None
    logprobs: list[TokenLogprob] = field(default_factory=list)  # per generated token, where options.logprobs is set
    given: Given | None = None  # a draft its prompt ends with, verified at its prefill (remote verification)

    @property
    def seeded(self) -> bool:
        return self.coupled is not None

    @staticmethod
    def of(index: int, ids: list[int], options: GenerationOptions, seed: int, max_context: int | None,
           seeded: bool = False, vocab: int = 0, matcher: "Matcher | None" = None) -> "Request":
        """vocab: the target's output ids (a seeded sampled request's draws are made over them);
        matcher: its constraint's parser, where options.constraint is set."""
        limit = max_context or 1 << 62
        generator = None if options.sampling.greedy else torch.Generator().manual_seed(seed)
        coupled = Coupled(seed, vocab) if seeded and generator is not None and vocab > 0 else None
        return Request(index, list(ids), len(ids), min(options.max_new_tokens, limit - len(ids)), options, generator,
                       coupled=coupled, matcher=matcher)

    @property
    def prompt(self) -> list[int]:
        return self.context[: self.prompt_len]

    @property
    def generated(self) -> list[int]:
        return self.context[self.prompt_len :]

    @property
    def tail(self) -> int:
        """The prompt's last tokens whose logits its prefill keeps: its given draft's and the one before it."""
        return 1 + (len(self.given.tokens) if self.given is not None else 0)

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def tokens_left(self) -> int:
        return self.max_new - len(self.generated)
