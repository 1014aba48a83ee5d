"""A lean forward for Llama-architecture decoders (Llama, SmolLM, Qwen2), over speclm's KV cache.

transformers' eager forward spends part of every step in Python (module calls, mask and
cache bookkeeping), which counts on a CPU next to int8 weights. This forward runs the same modules' weights with one flat loop per layer; the linear
layers are the model's own modules (nn.Linear or speclm.quant's int8 ones), so the model
object stays what transformers' `generate` uses too.

Attention is per query over exactly the slots before it (see speclm.attention for why),
except in a prefill, which is one SDPA call over the batch with a mask.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from speclm.attention import attend_each_query, is_prefill

SUPPORTED = ("llama", "qwen2")


def supports(model) -> bool:
    cfg = model.config
    inner = getattr(model, "model", None)
    return (
        getattr(cfg, "model_type", None) in SUPPORTED
        and getattr(cfg, "hidden_act", "silu") == "silu"
        and not getattr(cfg, "use_sliding_window", False)
        and inner is not None
        and hasattr(inner, "rotary_emb")
        and hasattr(inner.rotary_emb, "inv_freq")
        and getattr(inner.rotary_emb, "rope_type", "default") in ("default", "linear", "llama3", "yarn", "longrope")
    )


class LeanForward:
    def __init__(self, model):
        cfg = model.config
        inner = model.model
        self.embed = inner.embed_tokens
        self.layers = list(inner.layers)
        self.norm = inner.norm
        self.head = model.get_output_embeddings()
        self.heads = cfg.num_attention_heads
        self.kv_heads = getattr(cfg, "num_key_value_heads", None) or self.heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.heads
        self.scaling = self.head_dim**-0.5
        self.inv_freq = inner.rotary_emb.inv_freq.float()  # (D/2,)
        self.rope_scale = float(getattr(inner.rotary_emb, "attention_scaling", 1.0))

    def _rms(self, norm, x):  # the transformers formula: fp32 statistics, weight after
        x32 = x.float()
        return norm.weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)).to(x.dtype)

    @torch.inference_mode()
    def __call__(self, ids, positions, kv, starts, counts, mask, window, keep_cols):
        """ids, positions (B, M); kv: the StaticKV (its buffers are written at `positions`);
        starts, counts: per row, slots before this forward and new tokens; mask (B, 1, M, W);
        keep_cols: which columns' logits to return (a slice or an index tensor)."""
        batch, width = ids.shape
        h = self.embed(ids)  # (B, M, E)
        freqs = positions[..., None].float() * self.inv_freq  # (B, M, D/2)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = (emb.cos() * self.rope_scale).to(h.dtype)[:, :, None, :]  # (B, M, 1, D)
        sin = (emb.sin() * self.rope_scale).to(h.dtype)[:, :, None, :]
        half = self.head_dim // 2
        per_query = not is_prefill(starts)
        groups = self.heads // self.kv_heads
        rows = kv._rows[:, None]
        for i, layer in enumerate(self.layers):
            attn, mlp = layer.self_attn, layer.mlp
            x = self._rms(layer.input_layernorm, h)
            q = attn.q_proj(x).view(batch, width, self.heads, self.head_dim)
            k = attn.k_proj(x).view(batch, width, self.kv_heads, self.head_dim)
            v = attn.v_proj(x).view(batch, width, self.kv_heads, self.head_dim)
            q = q * cos + torch.cat((-q[..., half:], q[..., :half]), dim=-1) * sin
            k = k * cos + torch.cat((-k[..., half:], k[..., :half]), dim=-1) * sin
            keys, values = kv.keys[i], kv.values[i]  # (B, H_kv, capacity, D)
            keys[rows, :, positions] = k.to(keys.dtype)
            values[rows, :, positions] = v.to(values.dtype)
            if per_query:
                out = attend_each_query(q, keys, values, starts, counts, self.scaling)
            else:
                o = F.scaled_dot_product_attention(q.transpose(1, 2), keys[:, :, :window], values[:, :, :window],
                                                   attn_mask=mask, scale=self.scaling, enable_gqa=groups > 1)
                out = o.transpose(1, 2)
            h = h + attn.o_proj(out.reshape(batch, width, -1))
            x = self._rms(layer.post_attention_layernorm, h)
            h = h + mlp.down_proj(F.silu(mlp.gate_proj(x)) * mlp.up_proj(x))
        h = h[:, keep_cols] if isinstance(keep_cols, slice) else h[kv._rows[:, None], keep_cols]
        return self.head(self._rms(self.norm, h)).float()  # (B, K, V)
