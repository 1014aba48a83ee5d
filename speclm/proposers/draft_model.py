"""Drafting with a smaller model that shares the target's tokenizer.

The draft keeps its own preallocated KV cache (speclm.kv.StaticKV). Each proposal first feeds the committed tokens
the draft has not seen (at the start the prompt, then the target's first token, split as the
target fed them; afterwards the target's
recovered or bonus token, plus the last draft token when every draft was accepted), then
drafts autoregressively. Its last drafted token is never fed, so a fully accepted round
costs k draft forwards, not k+1.
"""

from __future__ import annotations

import torch

from speclm.proposers.base import Draft, Proposer
from speclm.kv import StaticKV
from speclm.sampling import SamplingParams, processed_probs, sample


class DraftModelProposer(Proposer):
    name = "draft"

    def __init__(self, model, k: int = 4, confidence: float = 0.0):
        """k: most tokens per round; confidence: a row stops drafting after a token the draft gave
        less than this probability (0: never), so a round where the draft is unsure costs
        fewer draft steps and a narrower verification. The stop depends on the draft alone, so
        sampling stays exact."""
        self.model, self.k, self.confidence = model, k, confidence
        self.kv: StaticKV | None = None

    def start(self, batch_size: int, capacity: int) -> None:
        self.kv = StaticKV(self.model, batch_size, capacity)

    @property
    def forward_seconds(self) -> float:
        return self.kv.forward_seconds if self.kv is not None else 0.0

    def propose(self, contexts, max_tokens, params: SamplingParams, generators) -> Draft:
        batch = len(contexts)
        width = min(self.k, max(max_tokens))
        if width <= 0:
            return Draft.empty(batch)
        have = self.kv.lengths_list()
        if not any(have) and all(len(c) > 1 for c in contexts):
            # The target prefilled the prompt alone and fed its first token in a decode forward;
            # mirror that split (a prefill attends batched, a decode forward per query, which
            # round differently), so that a draft equal to the target computes the same bits.
            self.kv.forward([c[:-1] for c in contexts], 1)
            have = self.kv.lengths_list()
        logits = self.kv.forward([c[h:] for c, h in zip(contexts, have)], 1)[:, -1]  # (B, V)
        tokens = torch.zeros(batch, width, dtype=torch.long)
        drafted = [min(width, max(m, 0)) for m in max_tokens]  # per row: its budget, cut where it stops
        probs = [] if not params.greedy else None
        steps = 0
        for j in range(width):
            if params.greedy:
                step = logits.argmax(-1)  # (B,)
                sure = torch.softmax(logits, -1).gather(-1, step[:, None])[:, 0] if self.confidence > 0 else None
                step = step.cpu()
            else:
                p = processed_probs(logits, params)  # (B, V)
                probs.append(p)
                step = torch.tensor([sample(p[b].cpu(), generators[b]) for b in range(batch)])
                sure = p.gather(-1, step[:, None].to(p.device))[:, 0] if self.confidence > 0 else None
            tokens[:, j] = step
            steps = j + 1
            if sure is not None:  # a row stops after a token its draft was unsure of
                unsure = (sure < self.confidence).tolist()
                drafted = [min(d, j + 1) if below else d for d, below in zip(drafted, unsure)]
            if any(d > j + 1 for d in drafted):  # some row still drafts: feed this step's tokens
                logits = self.kv.forward([[t] for t in step.tolist()], 1)[:, -1]
            else:
                break
        lengths = torch.tensor(drafted, dtype=torch.long)
        draft_probs = torch.stack(probs, dim=1) if probs is not None else None  # (B, steps, V)
        return Draft(tokens[:, :steps], lengths, draft_probs, forwards=steps)

    def rollback(self, keep: list[int]) -> None:
        self.kv.truncate(keep)

    def select(self, rows: list[int]) -> None:
        self.kv.select(rows)
