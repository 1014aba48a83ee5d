"""The trained heads' networks: Medusa's residual blocks and EAGLE's one decoder layer, and their
training losses.

Both read the target's feature at a token: its hidden state after the final norm (layer -1,
what its output head reads). Both score tokens through the target's own output head restricted
to a frequent-token vocabulary (`vocab_ids`, as FR-Spec restricts EAGLE's): the `Frozen` rows of
the target, never trained and never stored with the heads, so a file of heads stays small and
its logits are the target's own for a predicted feature.

- Medusa (`MedusaHeads`): head i (i = 1..K) maps the feature at token t through a residual block
  x + SiLU(W x) to logits for token t + 1 + i (token t + 1 is the target's own next token).
- EAGLE (`EagleHead`): one decoder layer of the target's architecture (RMSNorm, rotary GQA
  attention, SwiGLU MLP; its MLP narrower than the target's) over pairs (feature at t, embedding of
  token t + 1), fused by a linear map; its output predicts the feature at t + 1, whose logits
  through the output head give token t + 2. Drafting feeds its own predictions back.

Shapes: B rows, L tokens per training chunk, E the target's hidden size, V' the restricted
vocabulary, H/H_kv/D attention heads, key-value heads, head size.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

KINDS = ("medusa", "eagle")
IGNORE = -100  # a label outside the restricted vocabulary, or past the chunk: no loss there


@dataclass(frozen=True)
class HeadsConfig:
    kind: str  # medusa | eagle
    hidden_size: int  # E: the target's
    vocab: int  # V': the restricted vocabulary's size
    target_vocab_size: int  # the target's output ids (a file of heads must fit its target)
    target: str = ""  # the target the heads were trained on, as named in training
    heads: int = 4  # medusa: heads, the deepest draft
    num_heads: int = 12  # eagle: attention heads (the target's)
    kv_heads: int = 2  # eagle: key-value heads (the target's)
    head_dim: int = 128  # eagle
    intermediate: int = 2048  # eagle: its MLP's width (the target's is wider; a small head is the point)
    rope_theta: float = 1e6  # eagle: the target's rotary base
    eps: float = 1e-6  # eagle: RMSNorm's
    # eagle: decoder layers whose hidden states join the final feature as the head's real input
    # (EAGLE-3's fused features; () reads the final feature alone)
    fuse_layers: tuple[int, ...] = ()

    def to_dict(self) -> dict:
        return asdict(self)

    @staticmethod
    def from_dict(data: dict) -> "HeadsConfig":
        known = {f for f in HeadsConfig.__dataclass_fields__}
        values = {k: v for k, v in data.items() if k in known}
        values["fuse_layers"] = tuple(int(x) for x in values.get("fuse_layers", ()))
        return HeadsConfig(**values)

    @property
    def feature_layers(self) -> tuple[int, ...]:
        """The target layers a head reads at a real token, in the order its input joins them (-1:
        after the final norm)."""
        return (*self.fuse_layers, -1)


@dataclass
class Frozen:
    """The target's parts the heads use and never train."""

    head: torch.Tensor  # (V', E) fp32: the target's output head rows at vocab_ids
    embed: object = field(default=None, repr=False)  # ids (...) -> (..., E) fp32: the target's embedding (EAGLE)

    def logits(self, x: torch.Tensor) -> torch.Tensor:  # (..., E) -> (..., V')
        return x @ self.head.t()


def labels_in_vocab(tokens: torch.Tensor, vocab_ids: torch.Tensor, target_vocab_size: int) -> torch.Tensor:
    """Target ids (...) -> indices into the restricted vocabulary, IGNORE where absent."""
    index = torch.full((target_vocab_size,), IGNORE, dtype=torch.long)
    index[vocab_ids] = torch.arange(len(vocab_ids))
    return index[tokens.clamp(0, target_vocab_size - 1)]


class ResBlock(nn.Module):
    """x + SiLU(W x + b), W zero at the start: a fresh head is the target's own next-token head."""

    def __init__(self, size: int):
        super().__init__()
        self.linear = nn.Linear(size, size)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.silu(self.linear(x))


class MedusaHeads(nn.Module):
    def __init__(self, config: HeadsConfig):
        super().__init__()
        self.config = config
        self.blocks = nn.ModuleList(ResBlock(config.hidden_size) for _ in range(config.heads))

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        """features (..., E) -> (K, ..., E): each head's feature for its position ahead (the output
        head turns them into logits)."""
        return torch.stack([block(features) for block in self.blocks])

    def loss(self, frozen: Frozen, labels: torch.Tensor, features: torch.Tensor, mask: torch.Tensor,
             decay: float = 0.8) -> tuple[torch.Tensor, dict[str, float]]:
        """labels (B, L): restricted-vocabulary indices of the chunk's tokens (IGNORE outside it);
        features (B, L, E); mask (B, L): positions whose next tokens the target generated. Head i's
        loss at t is its cross-entropy for token t + 1 + i, weighted decay ** (i - 1) (the deeper
        heads are harder and matter less: their tokens are verified only after the earlier ones)."""
        total = features.new_zeros(())
        metrics = {}
        for i, block in enumerate(self.blocks, start=1):
            shift = 1 + i
            if labels.shape[1] <= shift:
                break
            target = labels[:, shift:].masked_fill(~mask[:, :-shift], IGNORE)  # (B, L - shift)
            logits = frozen.logits(block(features[:, :-shift]))  # (B, L - shift, V')
            valid = target != IGNORE
            if not bool(valid.any()):
                continue
            ce = F.cross_entropy(logits[valid], target[valid])
            total = total + decay ** (i - 1) * ce
            metrics[f"loss{i}"] = ce.detach().item()
            metrics[f"acc{i}"] = float((logits[valid].argmax(-1) == target[valid]).float().mean())
        return total, metrics


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


def rotary(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """x (B, H, M, D) rotated at positions (B, M), as the Qwen2/Llama decoders rotate (halves)."""
    dim = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32, device=x.device) / dim))  # (D/2,)
    angles = positions[:, None, :, None].float() * inv  # (B, 1, M, D/2)
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    half = dim // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], -1)
    return x * cos + rotated * sin


class PartsLinear(nn.Module):
    """A bias-free linear map over a concatenation [a, b], computed as one linear per part. Run on
    int8 kernels, each part then gets its own per-row activation scale: EAGLE's fused input joins
    the target's final-norm feature (entries up to about 60 on Qwen2.5) with a token's embedding
    (entries about 0.05), and under one shared scale the embedding would round to zero."""

    def __init__(self, linear: nn.Linear, sizes: tuple[int, ...]):
        super().__init__()
        assert linear.bias is None and sum(sizes) == linear.in_features
        self.sizes = tuple(sizes)
        self.parts = nn.ModuleList()
        start = 0
        for size in sizes:
            part = nn.Linear(size, linear.out_features, bias=False)
            with torch.no_grad():
                part.weight.copy_(linear.weight[:, start:start + size])
            self.parts.append(part)
            start += size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pieces = x.split(self.sizes, -1)
        out = self.parts[0](pieces[0])
        for part, piece in zip(self.parts[1:], pieces[1:]):
            out = out + part(piece)
        return out


class EagleHead(nn.Module):
    def __init__(self, config: HeadsConfig):
        super().__init__()
        self.config = c = config
        e = c.hidden_size
        self.fuse = nn.Linear(2 * e, e, bias=False)  # (feature at t, embedding of token t + 1) -> E
        self.norm1, self.norm2 = RMSNorm(e, c.eps), RMSNorm(e, c.eps)
        self.q = nn.Linear(e, c.num_heads * c.head_dim, bias=True)
        self.k = nn.Linear(e, c.kv_heads * c.head_dim, bias=True)
        self.v = nn.Linear(e, c.kv_heads * c.head_dim, bias=True)
        self.o = nn.Linear(c.num_heads * c.head_dim, e, bias=False)
        self.gate = nn.Linear(e, c.intermediate, bias=False)
        self.up = nn.Linear(e, c.intermediate, bias=False)
        self.down = nn.Linear(c.intermediate, e, bias=False)
        if c.fuse_layers:  # (states at fuse_layers..., final feature) -> E, at first the final feature alone
            self.reduce = nn.Linear(len(c.feature_layers) * e, e, bias=False)
            with torch.no_grad():
                self.reduce.weight.zero_()
                self.reduce.weight[:, -e:] = torch.eye(e)

    def lift(self, states: torch.Tensor) -> torch.Tensor:
        """The head's input feature at real tokens: states (..., F E), the target's states at
        config.feature_layers joined in that order -> (..., E). Without fuse layers, the final
        feature itself. Level 2 and deeper read the head's own predictions in its place."""
        return self.reduce(states) if self.config.fuse_layers else states

    def split_fused_input(self) -> None:
        """Compute `fuse` (and `reduce`) as one linear per input, the same maps: do this before
        their linears go onto int8 kernels (PartsLinear says why; a low layer's states are about
        a seventh of the final feature's size)."""
        e = self.config.hidden_size
        if isinstance(self.fuse, nn.Linear):
            self.fuse = PartsLinear(self.fuse, (e, e))
        if self.config.fuse_layers and isinstance(self.reduce, nn.Linear):
            self.reduce = PartsLinear(self.reduce, (e,) * len(self.config.feature_layers))

    def forward(self, features: torch.Tensor, embeddings: torch.Tensor, positions: torch.Tensor,
                past: tuple[torch.Tensor, torch.Tensor] | None = None, mask: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """features, embeddings (B, M, E): pairs (feature at t, embedding of token t + 1), at
        positions (B, M) (t + 1's); past: keys and values (B, H_kv, P, D) it attends before them;
        mask (B, M, P + M) bool: which of past + these each query sees (None: all of past and
        causally these). Returns the predicted features at t + 1 (B, M, E) and these tokens' keys
        and values (B, H_kv, M, D)."""
        c = self.config
        batch, width, _ = features.shape
        x = self.fuse(torch.cat([features, embeddings], -1))
        h = self.norm1(x)
        q = self.q(h).view(batch, width, c.num_heads, c.head_dim).transpose(1, 2)
        k = self.k(h).view(batch, width, c.kv_heads, c.head_dim).transpose(1, 2)
        v = self.v(h).view(batch, width, c.kv_heads, c.head_dim).transpose(1, 2)
        q, k = rotary(q, positions, c.rope_theta), rotary(k, positions, c.rope_theta)
        keys, values = (k, v) if past is None else (torch.cat([past[0], k], 2), torch.cat([past[1], v], 2))
        group = c.num_heads // c.kv_heads
        if mask is None and past is None:
            att = F.scaled_dot_product_attention(q, keys, values, is_causal=True, enable_gqa=group > 1)
        else:
            if mask is None:
                seen = keys.shape[2] - width
                mask = torch.ones(batch, width, keys.shape[2], dtype=torch.bool, device=x.device)
                mask[:, :, seen:] = torch.ones(width, width, dtype=torch.bool, device=x.device).tril()
            att = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask[:, None], enable_gqa=group > 1)
        x = x + self.o(att.transpose(1, 2).reshape(batch, width, -1))
        h = self.norm2(x)
        x = x + self.down(F.silu(self.gate(h)) * self.up(h))
        return x, k, v

    def loss(self, frozen: Frozen, labels: torch.Tensor, features: torch.Tensor, mask: torch.Tensor,
             tokens: torch.Tensor, positions: torch.Tensor, noise: float = 0.1, weight: float = 0.1,
             unroll: int = 1, decay: float = 0.8, aux: torch.Tensor | None = None
             ) -> tuple[torch.Tensor, dict[str, float]]:
        """tokens (B, L) target ids, positions (B, L) theirs. Level 1: the head predicts the
        feature at t + 1 from (feature at t, token t + 1) for t < L - 1. Loss: smooth L1 to the
        real feature, plus `weight` times the cross-entropy of its restricted logits against the
        target's own (restricted) distribution there, where mask[t + 1]. Input features get uniform
        noise of `noise` times their RMS (EAGLE's training noise).

        unroll > 1 (training-time test, as EAGLE-3 trains): level s reads level s - 1's
        prediction for t + s - 1 with token t + s and predicts the feature at t + s, attending the
        real pairs up to t + 1 and its own chain's earlier levels, as drafting does a node s deep
        (speclm.proposers.eagle); its loss is weighted decay ** (s - 1). Without it the head never
        sees its own predictions as input, and its second level drafts far worse than its first.

        aux (B, L, F' E): with fuse layers, the target's states at them (config.fuse_layers, in
        order); level 1 then reads lift(aux, feature) in place of the feature, each layer's part
        with noise of its own RMS."""
        inputs = features[:, :-1]
        if self.config.fuse_layers:
            if aux is None:
                raise ValueError("heads with fuse layers train on data with those layers (speclm heads layers)")
            inputs = torch.cat([aux[:, :-1], inputs], -1)
        if noise and self.training:
            parts = inputs.unflatten(-1, (-1, features.shape[-1]))  # (B, L - 1, F, E)
            scale = parts.pow(2).mean(-1, keepdim=True).sqrt()
            inputs = (parts + (torch.rand_like(parts) - 0.5) * 2 * noise * scale).flatten(-2)
        inputs = self.lift(inputs)
        predictions = self.unrolled(inputs, tokens, positions, frozen.embed, unroll)
        if not bool(mask[:, 1:].any()):
            return predictions[0].sum() * 0, {}
        total, metrics = predictions[0].new_zeros(()), {}
        for level, predicted in enumerate(predictions, start=1):
            loss, more = self._level(frozen, labels, features, predicted, mask[:, level:], level, weight)
            total = total + decay ** (level - 1) * loss
            metrics.update(more)
        return total, metrics

    def unrolled(self, inputs: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor, embed, levels: int
                 ) -> list[torch.Tensor]:
        """The head's predictions `levels` deep along every position, as drafting makes them:
        inputs (B, L - 1, E) the real features at 0..L-2, tokens and positions (B, L). Level 1
        reads (real feature at i, token i + 1); level s > 1 reads (level s - 1's prediction for
        i + s - 1, token i + s) at position i + s, attending the real pairs up to i + 1 (j <= i)
        and its own chain's earlier levels (as a node s - 1 deep attends the cache and its
        ancestors). Returns one (B, L - s, E) per level s, row i predicting the feature at i + s."""
        predicted, k, v = self(inputs, embed(tokens[:, 1:]), positions[:, 1:])
        out, keys, values = [predicted], [k], [v]
        length = tokens.shape[1]
        for level in range(2, levels + 1):
            m = length - level
            if m <= 0:
                break
            eye = torch.eye(m, dtype=torch.bool, device=tokens.device)
            seen = torch.cat([torch.ones(m, m, dtype=torch.bool, device=tokens.device).tril()] + [eye] * (level - 1), 1)
            past = (torch.cat([x[:, :, :m] for x in keys], 2), torch.cat([x[:, :, :m] for x in values], 2))
            predicted, k, v = self(predicted[:, :m], embed(tokens[:, level:]), positions[:, level:], past,
                                   seen.expand(tokens.shape[0], m, -1))
            out.append(predicted)
            keys.append(k)
            values.append(v)
        return out

    def _level(self, frozen: Frozen, labels, features, predicted, valid, level: int, weight: float
               ) -> tuple[torch.Tensor, dict]:
        """The loss and metrics of predictions (B, m, E) for the features at level + i, valid (B, m)."""
        m = predicted.shape[1]
        real = features[:, level: level + m]
        metrics: dict[str, float] = {}
        if not bool(valid.any()):
            return predicted.sum() * 0, metrics
        regression = F.smooth_l1_loss(predicted[valid], real[valid])
        with torch.no_grad():
            target_probs = F.softmax(frozen.logits(real[valid]), -1)
        ce = -(target_probs * F.log_softmax(frozen.logits(predicted[valid]), -1)).sum(-1).mean()
        suffix = "" if level == 1 else str(level)
        metrics["regression" + suffix] = regression.detach().item()
        metrics["ce" + suffix] = ce.detach().item()
        # top-1 against the token the target generated at level + 1 + i: acceptance `level` deep
        nxt = labels[:, level + 1: level + 1 + m]
        ok = valid[:, : nxt.shape[1]] & (nxt != IGNORE)
        if bool(ok.any()):
            pred = frozen.logits(predicted[:, : nxt.shape[1]][ok]).argmax(-1)
            metrics[f"acc{level}"] = float((pred == nxt[ok]).float().mean())
        return regression + weight * ce, metrics


def make(config: HeadsConfig) -> nn.Module:
    if config.kind == "medusa":
        return MedusaHeads(config)
    if config.kind == "eagle":
        return EagleHead(config)
    raise ValueError(f"unknown kind of heads '{config.kind}' (choose from {', '.join(KINDS)})")
