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
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from speclm.proposers.base import Draft
from speclm.sampling import SamplingParams, processed_probs


@dataclass
class Verdict:
    num_accepted: torch.Tensor  # (B,) long: accepted draft tokens per row
    tokens: torch.Tensor  # (B, K+1) long: row b commits tokens[b, : num_accepted[b] + 1]

    def committed(self, row: int) -> list[int]:
        return self.tokens[row, : int(self.num_accepted[row]) + 1].tolist()


def verify(
    target_logits: torch.Tensor,
    draft: Draft,
    params: SamplingParams,
    generators: list[torch.Generator | None],
) -> Verdict:
    """target_logits (B, K+1, V): the target's logits at the last committed token and at each
    draft token; position j scores the token that follows draft token j-1."""
    batch, width = draft.tokens.shape
    target_logits = target_logits.cpu()
    tokens = draft.tokens
    in_draft = torch.arange(width)[None, :] < draft.lengths[:, None]  # (B, K)
    if params.greedy:
        target_argmax = target_logits.argmax(-1)  # (B, K+1)
        accepted = (tokens == target_argmax[:, :width]) & in_draft
        num_accepted = accepted.long().cumprod(1).sum(1)
        # accepted positions equal the argmax, so the argmax row is also the committed row
        return Verdict(num_accepted, target_argmax)

    target_probs = processed_probs(target_logits, params)  # (B, K+1, V)
    p_draft_tok = target_probs[:, :width].gather(-1, tokens[..., None]).squeeze(-1)  # (B, K)
    if draft.draft_probs is None:
        q_draft_tok = torch.ones_like(p_draft_tok)
    else:
        q_draft_tok = draft.draft_probs.cpu().gather(-1, tokens[..., None]).squeeze(-1)
    uniform = torch.stack([torch.rand(width, generator=g) for g in generators]) if width else torch.zeros(batch, 0)
    accepted = (uniform * q_draft_tok < p_draft_tok) & in_draft  # u < p/q without dividing
    num_accepted = accepted.long().cumprod(1).sum(1)

    out = torch.zeros(batch, width + 1, dtype=torch.long)
    out[:, :width] = tokens
    for b in range(batch):
        n = int(num_accepted[b])
        dist = target_probs[b, n]
        if n < int(draft.lengths[b]):  # rejected at n: recovered token from the residual
            if draft.draft_probs is None:
                residual = dist.clone()
                residual[tokens[b, n]] = 0.0
            else:
                residual = (dist - draft.draft_probs[b, n].cpu()).clamp_min(0.0)
            if residual.sum() > 0:  # zero only if the rejection had probability zero (rounding)
                dist = residual / residual.sum()
        out[b, n] = torch.multinomial(dist, 1, generator=generators[b]).item()
    return Verdict(num_accepted, out)
