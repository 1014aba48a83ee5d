"""A transformers KV cache shared by the rows of a batch that advance at different speeds.

Rows are right-aligned: each forward appends the same number M of slots to every row, and
a row with fewer new tokens gets masked slots ("holes") on the left. Rolling back a row
turns its rejected slots into holes; slots that are holes in every row are cropped off
the end. Rollback is bookkeeping: the committed prefix is never recomputed or copied.

Each valid slot's position id is the number of valid slots before it in its row, so a row
sees exactly the positions and keys it would see alone.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache


class RaggedKV:
    def __init__(self, model, batch_size: int):
        self.model = model
        self.device = model.device
        self.cache = DynamicCache(config=model.config)
        self.slot_valid = torch.zeros(batch_size, 0, dtype=torch.bool, device=self.device)  # (B, S)
        self.lengths = torch.zeros(batch_size, dtype=torch.long, device=self.device)  # (B,) valid slots per row

    @property
    def batch_size(self) -> int:
        return self.slot_valid.shape[0]

    def lengths_list(self) -> list[int]:
        return self.lengths.tolist()

    @torch.inference_mode()
    def forward(self, rows: list[list[int]], logits_to_keep: int) -> torch.Tensor:
        """Append each row's tokens; return logits (B, logits_to_keep, V) of the last slots."""
        width = max(len(r) for r in rows)
        assert width >= logits_to_keep >= 1 and all(len(r) >= logits_to_keep for r in rows)
        ids = torch.zeros(self.batch_size, width, dtype=torch.long)
        valid = torch.zeros(self.batch_size, width, dtype=torch.bool)
        for b, row in enumerate(rows):
            if row:
                ids[b, width - len(row) :] = torch.tensor(row, dtype=torch.long)
                valid[b, width - len(row) :] = True
        ids, valid = ids.to(self.device), valid.to(self.device)
        positions = (self.lengths[:, None] + valid.cumsum(1) - 1).clamp_min(0)  # (B, M)
        mask = torch.cat([self.slot_valid, valid], dim=1)  # (B, S + M)
        out = self.model(
            input_ids=ids,
            attention_mask=mask.long(),
            position_ids=positions,
            past_key_values=self.cache,
            use_cache=True,
            logits_to_keep=logits_to_keep,
        )
        self.slot_valid = mask
        self.lengths = self.lengths + valid.sum(1)
        return out.logits.float()

    def truncate(self, keep: torch.Tensor | list[int]) -> None:
        """Keep only the first keep[b] valid slots of row b (keep (B,)); later ones become holes."""
        keep = torch.as_tensor(keep, dtype=torch.long, device=self.device)
        self.slot_valid = self.slot_valid & (self.slot_valid.cumsum(1) <= keep[:, None])
        self.lengths = torch.minimum(self.lengths, keep)
        used = self.slot_valid.any(0).nonzero()
        new_len = int(used[-1]) + 1 if len(used) else 0
        drop = self.slot_valid.shape[1] - new_len
        if drop:
            self.cache.crop(-drop)
            self.slot_valid = self.slot_valid[:, :new_len]

    def select(self, rows: torch.Tensor | list[int]) -> None:
        """Keep only these batch rows (finished rows leave the batch)."""
        rows = torch.as_tensor(rows, dtype=torch.long, device=self.device)
        self.cache.batch_select_indices(rows)
        self.slot_valid = self.slot_valid[rows]
        self.lengths = self.lengths[rows]
