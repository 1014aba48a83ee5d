"""What each decoder architecture computes, declared once and read by speclm.forward.lean's one
forward.

The causal LMs people run on their own machines share one shape: embeddings, then layers of
(norm, attention with rotary positions, residual, norm, gated MLP, residual), a final norm and
an output head. They differ in a handful of choices, which a Family names: which projections are
fused, the MLP's activation, whether a norm multiplies by 1 + weight, q/k norms per head, norms
after attention and MLP too, scaled embeddings, soft-capped logits. The per-layer choices (which
layers attend within a sliding window, which rotary table each reads) come from the model's own
modules and config, so a model's variant of its family needs no entry of its own. A model whose
family is not here runs on transformers' forward (speclm.forward.runner says so on stderr).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

# Rotary types the forward reads once ("dynamic" rescales as a sequence grows, which a table
# computed once cannot follow; "longrope" switches at one position: Rope.long_inv_freq).
STATIC_ROPE = ("default", "linear", "llama3", "yarn", "longrope")


@dataclass(frozen=True)
class Family:
    """The architecture-wide choices of a family of decoders."""

    qkv: tuple[str, ...] = ("q_proj", "k_proj", "v_proj")  # the attention's input projections: outputs q | k | v
    gate_up: tuple[str, ...] = ("gate_proj", "up_proj")  # the MLP's: outputs gate | up
    activation: str = "silu"  # act(gate) * up: "silu" or "gelu_tanh"
    norm_offset: float = 0.0  # 1.0: every RMSNorm multiplies by 1 + weight (Gemma)
    qk_norm: bool = False  # an RMSNorm over each head's q and k before rotary (q_norm, k_norm)
    sandwich: bool = False  # norms after attention and MLP as well (post_attention_layernorm, then
    #                         pre_feedforward_layernorm / post_feedforward_layernorm around the MLP)
    embed_scale: bool = False  # embeddings times sqrt(hidden) (where the embedding module does not)
    attn_softcap: bool = False  # attention scores cap * tanh(s / cap), config.attn_logit_softcapping
    every_layer_slides: bool = False  # config.sliding_window applies to every layer (Mistral, Phi-3)


FAMILIES: dict[str, Family] = {
    "llama": Family(),  # Llama 2/3.x, SmolLM
    "qwen2": Family(),
    "mistral": Family(every_layer_slides=True),
    "qwen3": Family(qk_norm=True),
    "phi3": Family(qkv=("qkv_proj",), gate_up=("gate_up_proj",), every_layer_slides=True),  # Phi-3, Phi-4
    "gemma2": Family(activation="gelu_tanh", norm_offset=1.0, sandwich=True, embed_scale=True, attn_softcap=True),
    "gemma3_text": Family(activation="gelu_tanh", norm_offset=1.0, qk_norm=True, sandwich=True, embed_scale=True),
}


@dataclass(frozen=True)
class Rope:
    inv_freq: torch.Tensor  # (D_rot / 2,) fp32
    scale: float  # transformers' attention_scaling: cos and sin are multiplied by it
    # LongRoPE (Phi-3.5, Phi-4-mini): the long factors' frequencies from position `switch`
    # (original_max_position_embeddings) on, the short ones before it: what transformers' rotary
    # gives a token decoded at each position (its forward's length past `switch` or not)
    long_inv_freq: torch.Tensor | None = None
    switch: int = 0


@dataclass(frozen=True)
class Decoder:
    """One model's decoder as the lean forward runs it."""

    family: Family
    scaling: float  # attention scores' scale
    attn_softcap: float | None
    final_softcap: float | None  # logits cap * tanh(logits / cap)
    embed_scale: float | None  # embeddings times this in the forward (None: not, or the embedding module does)
    windows: tuple[int, ...]  # per layer: its sliding window in keys, 0 for full attention
    ropes: tuple[str, ...]  # per layer: its rotary table, a key of `tables`
    tables: dict[str, Rope]
    rotary_dim: int  # features rotated per head (the first ones; the head's size unless partial)

    @property
    def projections(self) -> tuple[tuple[str, tuple[str, ...]], ...]:
        """A decoder layer's linear layers, by the part that holds them."""
        return (("self_attn", (*self.family.qkv, "o_proj")), ("mlp", (*self.family.gate_up, "down_proj")))


def family_of(model) -> Family | None:
    return FAMILIES.get(getattr(model.config, "model_type", None))


def _ropes(model, types: list[str]) -> tuple[dict[str, Rope], tuple[str, ...]] | None:
    """Each layer's rotary table: one per layer type where the model keeps them apart (Gemma 3's
    local and global layers), else one."""
    rotary = getattr(getattr(model, "model", None), "rotary_emb", None)
    if rotary is None:
        return None
    kinds = rotary.rope_type if isinstance(getattr(rotary, "rope_type", None), dict) else None
    if kinds is None:
        if not hasattr(rotary, "inv_freq") or getattr(rotary, "rope_type", "default") not in STATIC_ROPE:
            return None
        rope = (_longrope(model, rotary.inv_freq.device) if getattr(rotary, "rope_type", None) == "longrope"
                else Rope(rotary.inv_freq.float(), float(getattr(rotary, "attention_scaling", 1.0))))
        return {"": rope}, ("",) * len(types)
    tables = {}
    for kind in set(types):
        if kinds.get(kind) not in STATIC_ROPE or not hasattr(rotary, f"{kind}_inv_freq"):
            return None
        tables[kind] = Rope(getattr(rotary, f"{kind}_inv_freq").float(), float(getattr(rotary, f"{kind}_attention_scaling", 1.0)))
    return tables, tuple(types)


def _longrope(model, device) -> Rope:
    """LongRoPE's two tables: the short factors' frequencies, the long ones' from the original length
    on (computed from the config: transformers' rotary holds whichever its last forward switched to)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    init = ROPE_INIT_FUNCTIONS["longrope"]
    switch = int(model.config.rope_parameters["original_max_position_embeddings"])
    short, scale = init(model.config, device)
    long, _ = init(model.config, device, seq_len=switch + 1)
    return Rope(short.float(), float(scale), long.float(), switch)


def describe(model) -> Decoder | None:
    """The model's Decoder, or None where the lean forward cannot run it (then transformers'
    forward does; `why_not` says why)."""
    found = _describe(model)
    return found if isinstance(found, Decoder) else None


def why_not(model) -> str | None:
    """Why the lean forward cannot run this model, or None where it can."""
    found = _describe(model)
    return found if isinstance(found, str) else None


def _describe(model) -> Decoder | str:
    cfg, family = model.config, family_of(model)
    inner = getattr(model, "model", None)
    kind = getattr(cfg, "model_type", None)
    if family is None:
        return f"model_type {kind!r} is not one of {', '.join(FAMILIES)}"
    if inner is None or not hasattr(inner, "layers") or not hasattr(inner, "norm"):
        return f"a {kind} model without the usual .model.layers"
    act = getattr(cfg, "hidden_activation", None) or getattr(cfg, "hidden_act", "silu")
    if {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}.get(act) != family.activation:
        return f"activation {act!r}"
    if getattr(cfg, "use_bidirectional_attention", False):
        return "bidirectional attention"
    layers = list(inner.layers)
    types = list(getattr(cfg, "layer_types", None) or ["full_attention"] * len(layers))
    ropes = _ropes(model, types)
    if ropes is None:
        return f"rotary embedding other than {', '.join(STATIC_ROPE)}"
    attn = [layer.self_attn for layer in layers]
    if not all(hasattr(a, name) for a in attn for name in (*family.qkv, "o_proj")):
        return f"attention projections other than {', '.join(family.qkv)}"
    every = getattr(cfg, "sliding_window", None) if family.every_layer_slides else None
    windows = tuple(int(getattr(a, "sliding_window", every) or 0) for a in attn)
    heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    tables, per_layer = ropes
    rotary_dims = {2 * t.inv_freq.numel() for t in tables.values()}
    if len(rotary_dims) != 1 or next(iter(rotary_dims)) > head_dim:
        return "rotary tables of different sizes"
    return Decoder(
        family=family,
        scaling=float(getattr(attn[0], "scaling", head_dim**-0.5)),
        attn_softcap=getattr(cfg, "attn_logit_softcapping", None) if family.attn_softcap else None,
        final_softcap=getattr(cfg, "final_logit_softcapping", None),
        # transformers' scaled embedding module (Gemma 2 and 3), and speclm's compact table in its
        # place (speclm.forward.embedding), scale their own rows
        embed_scale=(cfg.hidden_size**0.5 if family.embed_scale and getattr(inner.embed_tokens, "embed_scale", None) is None
                     else None),
        windows=windows,
        ropes=per_layer,
        tables=tables,
        rotary_dim=next(iter(rotary_dims)),
    )


def norm_weight(norm: nn.Module, decoder: Decoder) -> torch.Tensor:
    """The weight an RMSNorm multiplies by: its own, or 1 + it (Gemma), computed in fp32 as
    transformers' Gemma norm does, in the weight's dtype."""
    w = norm.weight.detach()
    return w if not decoder.family.norm_offset else (decoder.family.norm_offset + w.float()).to(w.dtype)


def norm_eps(norm: nn.Module) -> float:
    return float(getattr(norm, "variance_epsilon", None) or getattr(norm, "eps"))
