"""The one verifier: decides, for every proposer, which drafted tokens are committed.

Words used throughout:
- accepted: draft tokens the target agrees with, a prefix of the draft;
- recovered: at the first rejected position, the token drawn instead from the residual
  distribution normalise(max(0, target_probs - draft_probs));
- bonus: when every draft token of a row is accepted, one more token drawn from the
  target's distribution at the next position (the target forward computed it anyway).
Each row commits its accepted tokens plus exactly one recovered or bonus token.

Greedy: a draft token is accepted when it equals the target's argmax; the recovered or bonus
token is the argmax. Sampling: token d at position j is accepted with probability
min(1, target_probs[j, d] / draft_probs[j, d]) (Leviathan et al. 2023, Chen et al. 2023),
which makes every committed token follow the target's processed distribution exactly.
A draft without probabilities (prompt lookup) is one-hot: draft_probs[j, d] = 1.

Alternatives (a tree whose extra branches are leaves): a draft may name, for position j, a
second candidate verified in the same target forward (its logits come after the chain's).
It counts only where the chain is rejected at j. Greedy: it is accepted when it is the target's
argmax, and the target's argmax after it is the bonus. Sampling (SpecInfer's multi-candidate
step, Miao et al. 2024): the alternative is a second draw from the same draft distribution q,
independent of the first; after the first is rejected, the target's distribution at j is the
residual p' = normalise(max(0, p - q)), and the alternative is accepted with probability
min(1, p'[a] / q[a]), else the recovered token is drawn from normalise(max(0, p' - q)). Each
step is an ordinary speculative step against the distribution left by the one before, so the
committed token still follows p exactly, whatever decided that j gets an alternative.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from speclm.proposers.base import Draft
from speclm.sampling import SamplingParams, processed_probs


@dataclass
class Verdict:
    num_accepted: torch.Tensor  # (B,) long: accepted draft tokens per row (an accepted alternative included)
    tokens: torch.Tensor  # (B, K+1) long: row b commits tokens[b, : num_accepted[b] + 1]
    # (B,) long: the position j whose alternative was accepted (then num_accepted = j + 1 and the
    # target's keys and values for it sit in its own slot, speclm.engine moves them), else -1
    alternative: torch.Tensor | None = None

    def committed(self, row: int) -> list[int]:
        return self.tokens[row, : int(self.num_accepted[row]) + 1].tolist()


def verify(
    target_logits: torch.Tensor,
    draft: Draft,
    params: SamplingParams,
    generators: list[torch.Generator | None],
) -> Verdict:
    """target_logits (B, K+1+A, V): the target's logits at the last committed token and at each
    draft token (position j scores the token that follows draft token j-1), then at each row's
    alternatives in the order of Draft.alternative_slots (A: the most any row has)."""
    batch, width = draft.tokens.shape
    target_logits = target_logits.cpu()
    tokens = draft.tokens
    in_draft = torch.arange(width)[None, :] < draft.lengths[:, None]  # (B, K)
    branches, _ = draft.alternative_slots()  # per row: [(j, token)], their logits at width + 1 + index
    alternative = torch.full((batch,), -1, dtype=torch.long)
    if params.greedy:
        target_argmax = target_logits.argmax(-1)  # (B, K+1+A)
        accepted = (tokens == target_argmax[:, :width]) & in_draft
        num_accepted = accepted.long().cumprod(1).sum(1)
        # accepted positions equal the argmax, so the argmax row is also the committed row
        out = target_argmax[:, : width + 1].clone()
        for b, row in enumerate(branches):
            n = int(num_accepted[b])
            for a, (j, t) in enumerate(row):
                if j == n < int(draft.lengths[b]) and t == int(target_argmax[b, n]):
                    out[b, n + 1] = target_argmax[b, width + 1 + a]  # the bonus after the alternative
                    num_accepted[b], alternative[b] = n + 1, n
                    break
        return Verdict(num_accepted, out, alternative)

    if any(branches) and draft.draft_probs is None:
        raise ValueError("sampled alternatives need the draft's distribution")
    target_probs = processed_probs(target_logits, params)  # (B, K+1+A, V)
    p_draft_tok = target_probs[:, :width].gather(-1, tokens[..., None]).squeeze(-1)  # (B, K)
    if draft.draft_probs is None:
        q_draft_tok = torch.ones_like(p_draft_tok)
    else:
        q_draft_tok = draft.draft_probs.cpu().gather(-1, tokens[..., None]).squeeze(-1)
    # each row draws one uniform per token it drafted, from its own generator: what a row draws does
    # not depend on the other rows of the batch (their draft lengths set `width`)
    uniform = torch.zeros(batch, width)
    for b, g in enumerate(generators):
        n = int(draft.lengths[b])
        if n:
            uniform[b, :n] = torch.rand(n, generator=g)
    accepted = (uniform * q_draft_tok < p_draft_tok) & in_draft  # u < p/q without dividing
    num_accepted = accepted.long().cumprod(1).sum(1)

    out = torch.zeros(batch, width + 1, dtype=torch.long)
    out[:, :width] = tokens
    for b in range(batch):
        n = int(num_accepted[b])
        dist = target_probs[b, n]
        if n < int(draft.lengths[b]):  # rejected at n: recovered token from the residual
            if draft.draft_probs is None:
                one_hot = torch.zeros_like(dist)
                one_hot[tokens[b, n]] = 1.0
                dist = _residual(dist, one_hot)
            else:
                dist = _residual(dist, draft.draft_probs[b, n].cpu())
            here = [(a, t) for a, (j, t) in enumerate(branches[b]) if j == n]
            if here:  # the alternative: a speculative step against the residual
                a, t = here[0]
                taken, dist = _alternative_step(dist, draft.draft_probs[b, n].cpu(), t, generators[b])
                if taken:
                    out[b, n] = t
                    out[b, n + 1] = torch.multinomial(target_probs[b, width + 1 + a], 1, generator=generators[b]).item()
                    num_accepted[b], alternative[b] = n + 1, n
                    continue
        out[b, n] = torch.multinomial(dist, 1, generator=generators[b]).item()
    return Verdict(num_accepted, out, alternative)


def _alternative_step(dist: torch.Tensor, q: torch.Tensor, token: int, generator) -> tuple[bool, torch.Tensor]:
    """dist (V,): the target's distribution left after the first candidate's rejection; q (V,):
    the draft distribution both candidates were drawn from. Accept `token` with probability
    min(1, dist[token] / q[token]); else return the distribution left for the recovered token."""
    if float(torch.rand(1, generator=generator)) * float(q[token]) < float(dist[token]):
        return True, dist
    return False, _residual(dist, q)


def _residual(dist: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """normalise(max(0, dist - q)): what is left of dist after a token drawn from q was rejected;
    dist itself if nothing is left (only if the rejection had probability zero: rounding)."""
    residual = (dist - q).clamp_min(0.0)
    return residual / residual.sum() if residual.sum() > 0 else dist
