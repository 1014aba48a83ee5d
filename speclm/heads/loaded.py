"""Trained heads loaded for one target, ready to draft (speclm.proposers.medusa, speclm.proposers.eagle)."""

from __future__ import annotations

from dataclasses import dataclass

from speclm.errors import UsageError
from speclm.models.loading import LoadedModel


def _compiled_kernels_only(module) -> None:
    """Drop the oneDNN-packed second copy of a head's int8 weights that SPECLM_ONEDNN=1 adds (by
    default there is none): speclm's compiled kernel runs every row count, the same bits
    (speclm.quant.weights), the head's bytes halved; only the prompt's one pass through an EAGLE
    head reads more than a few rows."""
    from speclm.quant.weights import Int8Linear, Int8Slice

    for m in module.modules():
        layer = m.fused.kernel if isinstance(m, Int8Slice) else m
        if isinstance(layer, Int8Linear) and layer.compiled is not None:
            layer.without_onednn()


@dataclass
class LoadedHeads:
    """Trained heads ready to draft for one target (speclm.heads)."""

    kind: str
    path: str
    module: object  # MedusaHeads or EagleHead, eval mode (int8 linears on a quantized target)
    vocab_ids: object  # (V',) long
    output_head: object  # (R, E) -> (R, V'): the target's head over vocab_ids
    embed: object  # ids -> (..., E) fp32: the target's embedding

    @staticmethod
    def load(path: str, kind: str, target: LoadedModel) -> "LoadedHeads":
        import torch

        from speclm.heads import store
        from speclm.heads.vocab import output_head
        from speclm.quant.weights import quantize_linears
        from speclm.runtime import release_freed_memory

        module, config, ids = store.load(path, target)
        if config.kind != kind:
            raise UsageError(f"heads {path} are {config.kind} heads, not {kind}")
        if target.quantize != "none":  # the heads' linears on the same int8 kernels as the target
            if kind == "eagle":
                module.split_fused_input()  # feature and embedding, each its own activation scale
            quantize_linears(module, "int8")
            _compiled_kernels_only(module)
        device = target.device  # where the target's features come from
        module, ids = module.to(device), ids.to(device)
        embed_table = target.model.get_input_embeddings()
        head = output_head(target.model, ids)
        release_freed_memory()  # the file's de-quantized fp32 weights, freed once on int8 kernels

        def embed(tokens):
            with torch.inference_mode():
                return embed_table(tokens.to(device)).float()

        return LoadedHeads(kind, str(path), module, ids, head, embed)

    @property
    def tree_file(self):
        """Where the tuned static tree shipped beside the heads lies (`<file>-tree.json`: Medusa's choices)."""
        from pathlib import Path

        path = Path(self.path)
        return path.with_name(path.stem + "-tree.json")

    def static_tree(self) -> tuple[tuple[int, ...], ...]:
        from speclm.proposers.draft_tree import parse_tree

        tree = self.tree_file
        if not tree.is_file():
            raise UsageError(f"--tree static: no tuned tree beside {self.path} ({tree.name}); use --tree auto or a FILE")
        return parse_tree(str(tree)).choices
