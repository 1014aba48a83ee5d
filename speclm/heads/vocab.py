"""The heads' restricted vocabulary (the target's most frequent output tokens, FR-Spec) and the
target's parts they read: its output head's rows at those ids and its embedding.

A head scores V' ids, not the target's whole vocabulary: the output head is the largest matrix a
head's step reads (151,936 x 1,536 for the default target), and a handful of frequent tokens
carry almost all of a model's output. A token outside the list is never drafted (the target
still produces it, at its own step).
"""

from __future__ import annotations

from collections import Counter

import torch
from torch import nn

from speclm.heads.modules import Frozen
from speclm.quant.weights import Int8Linear, QuantLinear, from_vnni_layout


def frequent_tokens(counts: Counter, size: int, always: tuple[int, ...] = ()) -> torch.Tensor:
    """The `size` ids counted most often (ties by id), `always` (EOS) among them, in ascending id order."""
    ranked = [t for t, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))]
    chosen = list(dict.fromkeys(list(always) + ranked))[:size]
    return torch.tensor(sorted(chosen), dtype=torch.long)


def head_rows(model, ids: torch.Tensor) -> torch.Tensor:
    """(S, E) fp32: the target's output-head rows at ids, as its forward computes with them
    (int8 weights de-quantized: w = q * scale)."""
    head = model.get_output_embeddings()
    with torch.no_grad():
        if isinstance(head, Int8Linear):
            if getattr(head, "compiled", None) is not None:
                q = from_vnni_layout(head.vnni_weight, head.out_features, head.in_features)
            else:
                q = head.qweight_t.t()
            return q[ids].float() * head.wscale[ids, None]
        if callable(getattr(head, "decoded", None)):  # the GGUF's own blocks (speclm.quant.gguf)
            return head.outputs(ids).decoded().values()
        if isinstance(head, QuantLinear):
            raise ValueError("heads read a target with fp32, bf16, int8 or GGUF weights, not int4")
        if isinstance(head, nn.Linear):
            return head.weight[ids].detach().float().clone()
    raise ValueError(f"unsupported output head {type(head).__name__}")


def frozen_parts(target, ids: torch.Tensor) -> Frozen:
    """The Frozen parts of a LoadedModel for vocabulary `ids`."""
    embed = target.model.get_input_embeddings()

    def lookup(tokens: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return embed(tokens).float()

    return Frozen(head=head_rows(target.model, ids), embed=lookup)


def output_head(model, ids: torch.Tensor):
    """(R, E) -> (R, V'): the target's output head over `ids` alone, as a head's drafts score them
    (on int8 weights a copy of those columns, each computed as the target computes it)."""
    head = model.get_output_embeddings()
    if isinstance(head, QuantLinear):
        return head.outputs(ids).rows
    weight = head.weight[ids].detach().float()
    bias = head.bias[ids].detach().float() if getattr(head, "bias", None) is not None else None
    return lambda x: torch.nn.functional.linear(x.to(weight.dtype), weight, bias)
