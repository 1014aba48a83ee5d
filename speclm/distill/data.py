"""Distillation data: the user's prompts, the target's greedy responses and the draft's own samples.

`prompts(spec)`: a JSON-lines file (the `generate --prompts` format: a "prompt" string or a
"turns" list per line) or `builtin:KIND`, speclm's own prompts of one Spec-Bench task kind made
from this machine's permissively licensed text (speclm.heads.sources). A file line that overlaps
the evaluation set (Spec-Bench, shipped with speclm, which the bench and the tests read) is
refused with its line number; built-in prompts that overlap are left out (speclm.heads.data's
EvalIndex: a shared 8-word n-gram, or near-duplicate word trigrams).

`build(...)` writes two folders in the heads' data format (speclm.heads.data: tokens, prompt
lengths, and the target's final hidden state at every token), resumably, shard by shard:
- data/target: each prompt with the target's greedy response (speclm.heads.data.build);
- data/draft: the same prompts with one sample of the draft's at temperature 1 (on-policy:
  the sequences the draft itself produces, DistillSpec's finding), the target's states read in
  one prefill forward per sequence.
The trainer turns a state into the target's distribution with the target's output head.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Iterable

import torch

from speclm.errors import UsageError
from speclm.files import atomic_write
from speclm.heads import data as heads_data
from speclm.heads.sources import KIND_WEIGHTS, Prompt, stream
from speclm.text import chat_ids

BUILTIN = "builtin:"
TARGET_DATA = "data/target"
DRAFT_DATA = "data/draft"
SAMPLE_TEMPERATURE = 1.0  # the draft's samples: its own distribution, untempered
# --samples: which sequences train (the target's greedy responses, the draft's own samples)
SAMPLES = {"both": (TARGET_DATA, DRAFT_DATA), "target": (TARGET_DATA,), "draft": (DRAFT_DATA,)}


def prompts(spec: str, seed: int = 0) -> Iterable[Prompt]:
    """The prompts `spec` names (the module's docstring): a list for a file, a lazy stream for builtin."""
    if spec.startswith(BUILTIN):
        kind = spec[len(BUILTIN):]
        if kind not in KIND_WEIGHTS:
            raise UsageError(f"--prompts {spec}: no built-in prompts of kind '{kind}' "
                             f"(choose from {', '.join(BUILTIN + k for k in KIND_WEIGHTS)})")
        return (p for p in stream(seed) if p.kind == kind)
    from speclm.prompts import prompt_of, read_json_lines

    path = Path(spec)
    records = read_json_lines(path, "prompt file")
    if not records:
        raise UsageError(f"prompt file {path} holds no prompts")
    index = heads_data.eval_index()
    out = []
    for line, record in records:
        text = prompt_of(record, f"{path}:{line}")
        if index.hits(text):
            raise UsageError(f"{path}:{line}: this prompt overlaps the evaluation set (Spec-Bench); evaluation "
                             "prompts never enter training: remove it")
        out.append(Prompt.of("user", f"{path.name}:{line}", "user", text))
    return out


def check_pair(target, draft) -> None:
    """The draft must share the target's tokenizer (its distributions are compared token by token)."""
    if draft.vocab_size != target.vocab_size:
        raise UsageError(f"the draft '{draft.name}' has a vocabulary of {draft.vocab_size} and the target "
                         f"'{target.name}' one of {target.vocab_size}: distillation needs the target's tokenizer")
    probe = "def f(x):\n    return x  # über, 数"
    if draft.tokenizer.encode(probe) != target.tokenizer.encode(probe):
        raise UsageError(f"the draft '{draft.name}' tokenizes text differently from the target '{target.name}'")


def build_target(target, out: Path, candidates: Iterable[Prompt], *, prompts_wanted: int, max_new_tokens: int,
                 max_prompt_tokens: int, batch_size: int, shard_size: int, seed: int, progress: bool) -> dict:
    """data/target (the module's docstring); returns its manifest."""
    manifest = heads_data.build(target, out / TARGET_DATA, prompts=prompts_wanted, max_new_tokens=max_new_tokens,
                                max_prompt_tokens=max_prompt_tokens, batch_size=batch_size, shard_size=shard_size,
                                seed=seed, progress=progress, candidates=candidates, source="given")
    stored = sum(s["sequences"] for s in manifest["shards"])
    if stored < manifest["prompts"]:
        raise UsageError(f"{out / TARGET_DATA} holds {stored} of {manifest['prompts']} sequences")
    return manifest


def _plan_of(folder: Path, tokenizer) -> list[tuple[Prompt, list[int]]]:
    plan = []
    for line in (folder / "prompts.jsonl").read_text(encoding="utf-8").splitlines():
        record = json.loads(line)
        plan.append((Prompt(**record), chat_ids(tokenizer, record["text"])))
    return plan


def build_draft(target, draft, out: Path, *, max_new_tokens: int, batch_size: int, shard_size: int, seed: int,
                progress: bool) -> dict:
    """data/draft for the prompts of data/target, in its order and shards (the module's docstring);
    shards already written (same prompts, recorded sha256) are kept. Returns its manifest."""
    from tqdm.auto import tqdm

    from speclm.engine import SpecEngine
    from speclm.forward.cache import StaticKV

    source = out / TARGET_DATA
    folder = out / DRAFT_DATA
    base = heads_data.load_manifest(source)
    plan = _plan_of(source, target.tokenizer)
    identity = {"format": heads_data.FORMAT, "target": base["target"], "quantize": base["quantize"],
                "layer": heads_data.LAYER, "max_new_tokens": max_new_tokens,
                "max_prompt_tokens": base["max_prompt_tokens"], "seed": seed, "shard_size": shard_size,
                "source": f"draft-samples:{draft.name}"}
    old = heads_data.existing_build(folder, identity)  # other arguments: a UsageError
    shards = heads_data.kept_shards(folder, old, plan, shard_size)
    folder.mkdir(parents=True, exist_ok=True)
    manifest = {**identity, "hidden_size": base["hidden_size"], "vocab_size": base["vocab_size"],
                "prompts": len(plan), "excluded_eval_overlap": base["excluded_eval_overlap"],
                "skipped_long_prompts": base["skipped_long_prompts"], "sources": base["sources"],
                "shards": shards, "data_sha256": heads_data.datafile_sha256(shards)}
    atomic_write(folder / "prompts.jsonl", (source / "prompts.jsonl").read_text(encoding="utf-8"))
    atomic_write(folder / "manifest.json", json.dumps(manifest, indent=1) + "\n")
    n_shards = -(-len(plan) // shard_size)
    if len(shards) == n_shards:
        return manifest
    engine = SpecEngine(draft)
    kv = StaticKV(target.model, 0, base["max_prompt_tokens"] + max_new_tokens + 1, pool=1)
    bar = tqdm(total=len(plan), initial=len(shards) * shard_size, desc="draft samples", unit="prompt",
               disable=not progress)
    try:
        for s in range(len(shards), n_shards):
            span = plan[s * shard_size:(s + 1) * shard_size]
            # one seed per shard, from the run's: a resumed build draws what an uninterrupted one would
            shard_seed = int.from_bytes(hashlib.sha256(f"{seed}:{s}".encode()).digest()[:6], "big")
            outs = engine.generate([ids for _, ids in span], batch_size=batch_size, method="none",
                                   temperature=SAMPLE_TEMPERATURE, seed=shard_seed, max_new_tokens=max_new_tokens)
            sequences = []
            for (prompt, ids), completion in zip(span, outs):
                tokens = ids + list(completion.token_ids)
                (row,) = kv.add(1)
                with torch.inference_mode():
                    kv.forward([tokens], 1, hidden_layers=(heads_data.LAYER,), only=[row], hidden_all=True)
                    states = kv.hidden[heads_data.LAYER][0, :len(tokens)].float()
                kv.select([])
                sequences.append((prompt.id, tokens, len(ids), states))
                bar.update(1)
            shards.append(heads_data.write_shard(folder / heads_data.shard_name(s), sequences))
            manifest["shards"], manifest["data_sha256"] = shards, heads_data.datafile_sha256(shards)
            atomic_write(folder / "manifest.json", json.dumps(manifest, indent=1) + "\n")
    finally:
        bar.close()
    return manifest


def data_folders(out: Path, samples: str) -> list[Path]:
    """The data folders a run trains on (SAMPLES[samples])."""
    if samples not in SAMPLES:
        raise UsageError(f"samples must be one of {', '.join(SAMPLES)}, not '{samples}'")
    return [out / f for f in SAMPLES[samples]]

