"""Training data for draft heads: the target's own greedy responses to prompts from this machine's
permissively licensed text (speclm.heads.sources) or to general-domain requests the target wrote
itself (speclm.heads.assistant), with the target's hidden state at every token.

`build` (1) takes prompts from `sources.stream(seed)` (source "library") or
`assistant.stream(...)` (source "assistant"), (2) leaves out every prompt that overlaps
the evaluation set (Spec-Bench, shipped with speclm: `overlap`), and prompts longer than
max_prompt_tokens in the target's chat template, (3) decodes each greedily with the target over
speclm's KV cache (self-distillation; continuous batching: up to batch_size rows decode, a
prompt joins with a prefill forward of its own and a row leaves at EOS or after max_new_tokens)
and (4) stores tokens and hidden states in safetensors shards, resumably.

The folder (the contract speclm's head trainer reads):
- prompts.jsonl: every prompt the build uses, in order: {"id", "kind", "source", "licence", "text"};
- shard-00000.safetensors, ...: shard i holds prompts [i * shard_size, (i + 1) * shard_size) of
  prompts.jsonl, each as one sequence (prompt ids + response ids; the response ends with its EOS
  where it stopped at one): `tokens` (T,) int32, the sequences one after another; `starts`
  (S + 1,) int64, where each begins in `tokens` (and the end); `prompt_lens` (S,) int32;
  `hidden` (T, E) bfloat16, the target's hidden state after its final norm (layer -1) at each
  token: the state from which it predicts the token after it. Metadata {"prompt_ids": JSON list};
- layers-00000.safetensors, ... (optional, `add_layers`: speclm heads layers): shard i's hidden
  states at more decoder layers, `layer{L}` (T, E) bfloat16 in the shard's token order, for
  heads that read several layers (EAGLE-3's fused features);
- requests.jsonl (source "assistant"): the seed requests answered so far, {"request", "answer"};
- manifest.json: {"format": 1, "target", "quantize", "layer": -1, "hidden_size", "vocab_size",
  "max_new_tokens", "max_prompt_tokens", "seed", "shard_size", "source", "prompts" (prompts in the plan),
  "excluded_eval_overlap", "skipped_long_prompts", "sources": [{"source", "licence", "prompts"}],
  "shards": [{"file", "sequences", "tokens", "response_tokens", "sha256"}], "data_sha256": the
  sha256 of the shards' sha256 hex digests concatenated in order, and with layers files
  "layers": {"layers", "shards": [{"file", "sha256"}]}}.

Resuming: a build into a folder that holds one with the same arguments keeps its shards whose
files still have the sha256 the manifest records, and goes on with the next prompts; a bigger
`prompts` extends it (the prompt order does not depend on the count). Shards and the manifest
are written to a temporary file and renamed, so an interrupted build leaves complete files only.

Bits: where the target's forward is batch-invariant (speclm's kernels on int8 weights,
StaticKV.chunk_invariant) the next shard's prompts join while the last ones of a shard decode,
and a resumed build's shards equal an uninterrupted one's. Elsewhere (fp32) a row's bits depend
on its batch, so each shard's batch drains before the next shard's prompts join: a shard's rows
then always decode in the same company, and resumed and uninterrupted builds again agree.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import time
from collections import deque
from pathlib import Path
from typing import Iterable, Iterator, Sequence

import torch

from speclm.files import atomic_write
from speclm.errors import UsageError
from speclm.models.store import file_sha256
from speclm.heads import assistant
from speclm.heads.sources import Prompt, stream
from speclm.forward.cache import StaticKV
from speclm.text import chat_ids

FORMAT = 1
LAYER = -1
DEFAULT_TARGET = "qwen2.5-coder-1.5b"
NGRAM = 8  # a prompt sharing a word n-gram this long with an evaluation turn is left out
NEAR_DUPLICATE = 0.5  # ... and one whose word trigrams overlap a turn's this much (Jaccard)
# the manifest's fields a resumed build must agree on
IDENTITY = ("format", "target", "quantize", "layer", "max_new_tokens", "max_prompt_tokens", "seed", "shard_size", "source")
# speclm.heads.sources; speclm.heads.assistant (requests the target writes); the caller's `candidates`
SOURCES = ("library", "assistant", "given")


# ---------------------------------------------------------------- evaluation overlap
_WORD = re.compile(r"\w+")


def _words(text: str) -> list[str]:
    """Lowercased words: whitespace and punctuation only separate them."""
    return _WORD.findall(text.lower())


def _grams(words: list[str], n: int) -> set[tuple[str, ...]]:
    return {tuple(words[i: i + n]) for i in range(len(words) - n + 1)}


def eval_texts() -> list[str]:
    """Every turn of the evaluation set shipped with speclm (Spec-Bench)."""
    from speclm.prompts import spec_bench

    return [t for record in spec_bench() for t in record["turns"] if isinstance(t, str)]


class EvalIndex:
    """Which texts overlap a set of evaluation texts: they share a word NGRAM-gram with one, or are
    a near-duplicate of one (the same words, or word trigrams overlapping by Jaccard >=
    NEAR_DUPLICATE), words lowercased and split at whitespace and punctuation."""

    def __init__(self, texts: Iterable[str]):
        self.long: set[tuple[str, ...]] = set()
        self.exact: set[tuple[str, ...]] = set()
        self.trigrams: dict[tuple[str, ...], list[int]] = {}
        self.sizes: list[int] = []
        for text in texts:
            words = _words(text)
            self.long |= _grams(words, NGRAM)
            self.exact.add(tuple(words))
            tri = _grams(words, 3)
            for g in tri:
                self.trigrams.setdefault(g, []).append(len(self.sizes))
            self.sizes.append(len(tri))

    def hits(self, text: str) -> bool:
        words = _words(text)
        if tuple(words) in self.exact:
            return True
        if any(tuple(words[i: i + NGRAM]) in self.long for i in range(len(words) - NGRAM + 1)):
            return True
        tri = _grams(words, 3)
        shared: dict[int, int] = {}
        for g in tri:
            for turn in self.trigrams.get(g, ()):
                shared[turn] = shared.get(turn, 0) + 1
        return any(n / (len(tri) + self.sizes[t] - n) >= NEAR_DUPLICATE for t, n in shared.items())


@functools.lru_cache(maxsize=1)
def eval_index() -> EvalIndex:
    return EvalIndex(eval_texts())


def overlap(prompts: Iterable[Prompt], eval_texts_: Iterable[str] | None = None) -> set[str]:
    """The ids of the prompts that overlap the evaluation texts (default: Spec-Bench's turns;
    EvalIndex says how)."""
    index = eval_index() if eval_texts_ is None else EvalIndex(eval_texts_)
    return {p.id for p in prompts if index.hits(p.text)}


# ---------------------------------------------------------------- generation
def _text_config(model):
    return getattr(model.config, "text_config", None) or model.config


def hidden_size(model) -> int:
    return int(_text_config(model).hidden_size)


def num_layers(model) -> int:
    """The model's decoder layers (`hidden_layers` indices 0..num_layers - 1)."""
    return int(_text_config(model).num_hidden_layers)


class _Row:
    __slots__ = ("index", "prompt", "response", "states")

    def __init__(self, index: int, prompt: list[int], first: int, states: torch.Tensor):
        self.index, self.prompt, self.response, self.states = index, prompt, [first], [states]


@torch.inference_mode()
def distill(target, prompts: Sequence[Sequence[int]], *, max_new_tokens: int = 256, batch_size: int = 16,
            kv: StaticKV | None = None, on_step=None) -> Iterator[tuple[int, list[int], torch.Tensor]]:
    """The target's greedy responses to prompts (token ids), with its hidden states: yields
    (index into prompts, response ids, hidden (len(prompt) + len(response), E) float32) as each
    finishes. Up to batch_size rows decode at once; a prompt joins with a prefill forward of its
    own (hidden states at all its tokens); a row leaves at any of target.eos_token_ids (kept in
    the response) or after max_new_tokens, its last token fed once more for the state at it.
    kv: a StaticKV of the target's with no rows, to use (None: a new one); on_step(n): called
    after each decode forward with the number of tokens it generated."""
    eos = set(target.eos_token_ids)
    if kv is None:
        longest = max((len(p) for p in prompts), default=1)
        kv = StaticKV(target.model, 0, longest + max_new_tokens + 1, pool=batch_size)
    waiting = deque((i, list(p)) for i, p in enumerate(prompts))
    rows: list[_Row] = []  # in the cache's batch order
    while waiting or rows:
        while waiting and len(rows) < batch_size:
            i, ids = waiting.popleft()
            (b,) = kv.add(1)
            logits = kv.forward([ids], 1, hidden_layers=(LAYER,), only=[b], hidden_all=True)  # (1, 1, V)
            states = kv.hidden[LAYER][0, : len(ids)].float()
            rows.append(_Row(i, ids, int(logits[0, -1].argmax()), states))
        logits = kv.forward([[r.response[-1]] for r in rows], 1, hidden_layers=(LAYER,))  # (B, 1, V)
        states = kv.hidden[LAYER][:, 0].float()  # (B, E): at each row's last token
        following = logits[:, -1].argmax(-1).tolist()
        keep, done = [], []
        for b, r in enumerate(rows):
            r.states.append(states[b: b + 1])
            if r.response[-1] in eos or len(r.response) >= max_new_tokens:
                done.append(r)
            else:
                r.response.append(following[b])
                keep.append(b)
        if on_step is not None:
            on_step(len(keep))
        if done:
            kv.select(keep)
            rows = [rows[b] for b in keep]
        for r in done:
            yield r.index, r.response, torch.cat(r.states)


# ---------------------------------------------------------------- files


def shard_name(i: int) -> str:
    return f"shard-{i:05d}.safetensors"


def write_shard(path: Path, sequences: list[tuple[str, list[int], int, torch.Tensor]]) -> dict:
    """sequences: (prompt id, token ids, prompt length, hidden (n, E)); returns its manifest entry."""
    from safetensors.torch import save_file

    lengths = [len(ids) for _, ids, _, _ in sequences]
    starts = torch.zeros(len(sequences) + 1, dtype=torch.int64)
    starts[1:] = torch.tensor(lengths, dtype=torch.int64).cumsum(0)
    tensors = {
        "tokens": torch.tensor([t for _, ids, _, _ in sequences for t in ids], dtype=torch.int32),
        "starts": starts,
        "prompt_lens": torch.tensor([n for _, _, n, _ in sequences], dtype=torch.int32),
        "hidden": torch.cat([h for _, _, _, h in sequences]).to(torch.bfloat16).contiguous(),
    }
    tmp = path.with_name(path.name + ".tmp")
    save_file(tensors, str(tmp), metadata={"prompt_ids": json.dumps([pid for pid, _, _, _ in sequences])})
    sha = file_sha256(tmp)
    os.replace(tmp, path)
    prompt_tokens = sum(n for _, _, n, _ in sequences)
    return {"file": path.name, "sequences": len(sequences), "tokens": sum(lengths),
            "response_tokens": sum(lengths) - prompt_tokens, "sha256": sha}


def shard_prompt_ids(path: Path) -> list[str]:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return json.loads((f.metadata() or {}).get("prompt_ids", "[]"))


def datafile_sha256(shards: list[dict]) -> str:
    return hashlib.sha256("".join(s["sha256"] for s in shards).encode("ascii")).hexdigest()


def load_manifest(out_dir) -> dict:
    """The manifest of a data folder; UsageError where there is none or it cannot be read."""
    path = Path(out_dir) / "manifest.json"
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError as exc:
        raise UsageError(f"{out_dir} holds no head training data (no manifest.json); build it with `speclm heads data`") from exc
    except (OSError, ValueError) as exc:
        raise UsageError(f"cannot read {path}: {exc}") from exc
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise UsageError(f"{path} is not a format-{FORMAT} head training data manifest")
    return manifest


def _chosen(manifest: dict, shards) -> list[dict]:
    entries = manifest["shards"]
    if shards is None:
        return entries
    by_name = {e["file"]: e for e in entries}
    out = []
    for s in shards:
        if isinstance(s, int):
            if not 0 <= s < len(entries):
                raise UsageError(f"shard {s} is not in the data ({len(entries)} shards)")
            out.append(entries[s])
        elif s in by_name:
            out.append(by_name[s])
        else:
            raise UsageError(f"shard {s} is not in the data")
    return out


def read_shards(out_dir, shards=None, verify: bool = False) -> Iterator[dict]:
    """Each shard of a data folder (`shards`: their indices or file names; None: all), in order,
    as {"file", "prompt_ids", "tokens", "starts", "prompt_lens", "hidden"} (the stored tensors);
    verify: check each file's sha256 against the manifest first (UsageError if it differs)."""
    from safetensors.torch import load_file

    out_dir = Path(out_dir)
    for entry in _chosen(load_manifest(out_dir), shards):
        path = out_dir / entry["file"]
        if verify and file_sha256(path) != entry["sha256"]:
            raise UsageError(f"{path} does not have the sha256 the manifest records; rebuild it")
        tensors = load_file(str(path))
        yield {"file": entry["file"], "prompt_ids": shard_prompt_ids(path), **tensors}


def iter_sequences(out_dir, shards=None) -> Iterator[tuple[torch.Tensor, torch.Tensor, int]]:
    """(tokens LongTensor (n,), hidden bfloat16 (n, E), prompt length) of each stored sequence;
    hidden[j] is the target's state at tokens[j], from which it predicted tokens[j + 1]."""
    for shard in read_shards(out_dir, shards):
        starts = shard["starts"].tolist()
        for s, (a, b) in enumerate(zip(starts, starts[1:])):
            yield shard["tokens"][a:b].long(), shard["hidden"][a:b], int(shard["prompt_lens"][s])


# ---------------------------------------------------------------- build
def _check(**values) -> None:
    for name, value in values.items():
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise UsageError(f"{name.replace('_', '-')} must be an integer >= 1, got {value!r}")


def existing_build(out: Path, identity: dict) -> dict | None:
    """The manifest of the build already in `out` (None: none yet); UsageError where it was made
    with other arguments, or `out` is something else."""
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {out} exists and is not a folder")
    if not (out / "manifest.json").is_file():
        if out.is_dir() and any(not p.name.endswith(".tmp") and p.name != assistant.FILE for p in out.iterdir()):
            raise UsageError(f"--out {out} is a folder that holds other files, not head training data; choose a new one")
        return None
    old = load_manifest(out)
    old.setdefault("source", "library")  # folders built before there was a choice
    differ = [k for k in IDENTITY if old.get(k) != identity[k]]
    if differ:
        was = ", ".join(f"{k}={old.get(k)}" for k in differ)
        now = ", ".join(f"{k}={identity[k]}" for k in differ)
        raise UsageError(f"{out} holds data built with {was}; this build asks {now}: "
                         "repeat the first build's arguments to continue it, or choose another --out")
    return old


def _plan(tokenizer, candidates: Iterable[Prompt], want: int | None, max_prompt_tokens: int,
          progress: bool) -> tuple[list[tuple[Prompt, list[int]]], int, int]:
    """The prompts the build uses, in order, with their ids: candidates that overlap no evaluation
    turn and fit max_prompt_tokens, at most `want`; and how many overlapped, how many were too long."""
    from tqdm.auto import tqdm

    if not getattr(tokenizer, "chat_template", None):
        raise UsageError("the target's tokenizer has no chat template; head data are built from chat prompts")
    index = eval_index()
    plan: list[tuple[Prompt, list[int]]] = []
    seen: set[str] = set()
    excluded = long = 0
    with tqdm(total=want, desc="collect prompts", unit="prompt", disable=not progress) as bar:
        for p in candidates:
            if want is not None and len(plan) >= want:
                break
            if p.id in seen:
                continue
            seen.add(p.id)
            if index.hits(p.text):
                excluded += 1
                continue
            ids = chat_ids(tokenizer, p.text)
            if not ids or len(ids) > max_prompt_tokens:
                long += 1
                continue
            plan.append((p, ids))
            bar.update(1)
    return plan, excluded, long


def _sources(plan: list[tuple[Prompt, list[int]]]) -> list[dict]:
    counts: dict[tuple[str, str], int] = {}
    for p, _ in plan:
        key = (p.source.split(":")[0], p.licence)
        counts[key] = counts.get(key, 0) + 1
    return [{"source": s, "licence": lic, "prompts": n}
            for (s, lic), n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))]


def kept_shards(out: Path, old: dict | None, plan: list[tuple[Prompt, list[int]]], shard_size: int) -> list[dict]:
    """The leading shards of an earlier build that stay: their file has the recorded sha256 and
    holds the plan's prompts for it, all of them."""
    kept: list[dict] = []
    for i, entry in enumerate(old["shards"] if old else []):
        path = out / str(entry.get("file"))
        if entry.get("file") != shard_name(i) or not path.is_file() or file_sha256(path) != entry.get("sha256"):
            break
        ids = shard_prompt_ids(path)
        wanted = [p.id for p, _ in plan[i * shard_size: (i + 1) * shard_size]]
        if ids != wanted[: len(ids)]:
            raise UsageError(f"{path} holds other prompts than this build's: the prompt sources changed since "
                             "(Python version, installed packages?); build into another --out")
        if len(ids) != len(wanted):  # a last shard cut short by an earlier --prompts: redone, longer
            break
        kept.append(entry)
    return kept


def _answerer(target, batch_size: int, progress: bool):
    """texts -> the target's greedy answers (chat template, assistant.MAX_NEW_TOKENS at most, within
    its context), for the seed requests of speclm.heads.assistant."""
    from tqdm.auto import tqdm

    tokenizer = target.tokenizer

    def answer(texts: list[str]) -> list[str]:
        ids = [chat_ids(tokenizer, t) for t in texts]
        new = assistant.MAX_NEW_TOKENS
        if target.max_context:  # within the target's context
            new = min(new, target.max_context - max(map(len, ids)) - 1)
        out = [""] * len(texts)
        with tqdm(total=len(texts), desc="seed requests", unit="request", disable=not progress) as bar:
            for i, response, _ in distill(target, ids, max_new_tokens=new, batch_size=batch_size):
                out[i] = tokenizer.decode(response, skip_special_tokens=True)
                bar.update(1)
        return out

    return answer


def build(target, out_dir, *, prompts: int | None = None, max_new_tokens: int = 256, max_prompt_tokens: int = 512,
          batch_size: int = 16, shard_size: int = 64, seed: int = 0, progress: bool = True,
          minutes: float | None = None, candidates: Iterable[Prompt] | None = None, source: str = "library") -> dict:
    """Build (or continue) the training data in out_dir (the module's docstring says what it holds);
    returns the manifest.

    target: a catalog name (or anything load_model takes; loaded with int8 weights) or a
    LoadedModel. prompts: the most prompts to use (None: every one the sources give, up to
    sources.MAX_POOL); a folder that already holds more keeps them. minutes: stop after the
    shard that is being made when this much time has passed (the same call again continues).
    candidates: the prompts to choose from, in order (default: by `source`: "library",
    sources.stream(seed); "assistant", the requests the target writes, speclm.heads.assistant).
    """
    from tqdm.auto import tqdm

    from speclm.models.loading import LoadedModel, load_model

    started = time.monotonic()
    _check(prompts=prompts, max_new_tokens=max_new_tokens, max_prompt_tokens=max_prompt_tokens,
           batch_size=batch_size, shard_size=shard_size)
    if minutes is not None and not minutes >= 0:
        raise UsageError(f"minutes must be >= 0, got {minutes}")
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise UsageError(f"seed must be an integer, got {seed!r}")
    if source not in SOURCES:
        raise UsageError(f"source must be one of {', '.join(SOURCES)}, got {source!r}")
    if source == "given" and candidates is None:
        raise UsageError("source 'given' needs the candidates")
    loaded = isinstance(target, LoadedModel)
    name, quantize = (target.name, target.quantize) if loaded else (str(target), "int8")
    out = Path(out_dir)
    identity = {"format": FORMAT, "target": name, "quantize": quantize, "layer": LAYER, "max_new_tokens": max_new_tokens,
                "max_prompt_tokens": max_prompt_tokens, "seed": seed, "shard_size": shard_size, "source": source}
    old = existing_build(out, identity)  # before loading: a mismatch fails at once
    if not loaded:
        target = load_model(name, quantize="int8", progress=progress)
    size, vocab = hidden_size(target.model), target.vocab_size
    if old is not None and (old.get("hidden_size"), old.get("vocab_size")) != (size, vocab):
        raise UsageError(f"{out} holds data of a model with hidden size {old.get('hidden_size')} and vocabulary "
                         f"{old.get('vocab_size')}; '{name}' has {size} and {vocab}: choose another --out")
    limit = target.max_context
    if limit and max_prompt_tokens + max_new_tokens > limit:
        raise UsageError(f"max-prompt-tokens + max-new-tokens = {max_prompt_tokens + max_new_tokens} exceeds "
                         f"the target's context of {limit} tokens")
    want = prompts
    if old is not None and want is not None:  # a smaller --prompts keeps what is there
        want = max(want, sum(int(s.get("sequences", 0)) for s in old["shards"]))
    if candidates is None and source == "assistant":
        out.mkdir(parents=True, exist_ok=True)
        candidates = assistant.stream(_answerer(target, batch_size, progress), out, seed, batch_size)
    plan, excluded, long = _plan(target.tokenizer, stream(seed) if candidates is None else candidates, want,
                                 max_prompt_tokens, progress)
    if not plan:
        raise UsageError(f"no prompts left to build from (overlapping the evaluation set: {excluded}, longer "
                         f"than {max_prompt_tokens} tokens: {long})")
    out.mkdir(parents=True, exist_ok=True)
    shards = kept_shards(out, old, plan, shard_size)
    manifest = {**identity, "hidden_size": size, "vocab_size": vocab, "prompts": len(plan),
                "excluded_eval_overlap": excluded, "skipped_long_prompts": long, "sources": _sources(plan),
                "shards": shards, "data_sha256": datafile_sha256(shards)}
    manifest = {k: manifest[k] for k in ("format", "target", "quantize", "layer", "hidden_size", "vocab_size",
                                         "max_new_tokens", "max_prompt_tokens", "seed", "shard_size", "source", "prompts",
                                         "excluded_eval_overlap", "skipped_long_prompts", "sources", "shards",
                                         "data_sha256")}
    if old is not None and old.get("layers"):  # a continued build keeps its layers files (add_layers extends them)
        manifest["layers"] = old["layers"]
    atomic_write(out / "manifest.json", json.dumps(manifest, indent=1) + "\n")
    atomic_write(out / "prompts.jsonl", "".join(json.dumps(p.to_dict(), ensure_ascii=False) + "\n" for p, _ in plan))

    n_shards = -(-len(plan) // shard_size)
    first = len(shards) * shard_size
    if len(shards) == n_shards:
        return manifest
    kv = StaticKV(target.model, 0, max_prompt_tokens + max_new_tokens + 1, pool=batch_size)
    todo = list(range(first, len(plan)))
    # batch-invariant bits: one stream across shards; else each shard's batch drains first
    groups = [todo] if kv.chunk_invariant else [todo[i: i + shard_size] for i in range(0, len(todo), shard_size)]
    finished: dict[int, tuple[list[int], torch.Tensor]] = {}
    next_shard = len(shards)
    stop = False
    done_bar = tqdm(total=len(plan), initial=first, desc="prompts", unit="prompt", disable=not progress)
    token_bar = tqdm(desc="generated", unit="tok", disable=not progress)
    try:
        for group in groups:
            results = distill(target, [plan[i][1] for i in group], max_new_tokens=max_new_tokens,
                              batch_size=batch_size, kv=kv, on_step=token_bar.update)
            for j, response, hidden in results:
                finished[group[j]] = (response, hidden.to(torch.bfloat16))  # as stored: half the memory while it waits
                done_bar.update(1)
                token_bar.update(1)  # the first token, from the prefill
                while next_shard < n_shards:
                    span = range(next_shard * shard_size, min(len(plan), (next_shard + 1) * shard_size))
                    if any(i not in finished for i in span):
                        break
                    sequences = []
                    for i in span:
                        response, hidden = finished.pop(i)
                        prompt, ids = plan[i]
                        sequences.append((prompt.id, ids + response, len(ids), hidden))
                    shards.append(write_shard(out / shard_name(next_shard), sequences))
                    manifest["shards"], manifest["data_sha256"] = shards, datafile_sha256(shards)
                    atomic_write(out / "manifest.json", json.dumps(manifest, indent=1) + "\n")
                    next_shard += 1
                    if minutes is not None and time.monotonic() - started >= 60 * minutes:
                        stop = True
                        break
                if stop:
                    results.close()
                    break
            if stop:
                break
    finally:
        done_bar.close()
        token_bar.close()
    return manifest


# ---------------------------------------------------------------- more layers
def _layers_name(i: int) -> str:
    return f"layers-{i:05d}.safetensors"


@torch.inference_mode()
def add_layers(out_dir, layers: Sequence[int], target=None, *, progress: bool = False,
               minutes: float | None = None) -> dict:
    """Add the target's hidden states at `layers` (decoder layer indices: the residual stream after
    that layer) to a built data folder, for heads that read several layers (EAGLE-3's fused
    features). Each shard's sequences are fed again in one teacher-forced prefill each (no
    generation: the tokens are the stored ones); shard i's states go to layers-0000i.safetensors
    as `layer{L}` (T, E) bfloat16, in the shard's token order. The manifest's "layers" records
    {"layers", "shards": [{"file", "sha256"}]}; a second call keeps the files whose sha256 match and
    goes on (minutes: stop after the shard in progress once this much time has passed).
    target: a catalog name or LoadedModel (default: the manifest's, int8)."""
    from safetensors.torch import save_file
    from tqdm.auto import tqdm

    from speclm.models.loading import LoadedModel, load_model

    started = time.monotonic()
    out = Path(out_dir)
    manifest = load_manifest(out)
    layers = sorted(set(int(x) for x in layers))
    if not isinstance(target, LoadedModel):
        name = target or manifest["target"]
        if name != manifest["target"]:
            raise UsageError(f"{out} was built with '{manifest['target']}', not '{name}'")
        target = load_model(name, quantize=manifest.get("quantize", "int8"), progress=progress)
    depth = num_layers(target.model)
    if not layers or any(not 0 <= layer < depth for layer in layers):
        raise UsageError(f"layers must be decoder layer indices in 0..{depth - 1}, got {layers}")
    old = manifest.get("layers") or {}
    kept = list(old.get("shards", [])) if old.get("layers") == layers else []
    kept = [e for e in kept[: len(manifest["shards"])] if (out / e["file"]).exists() and file_sha256(out / e["file"]) == e["sha256"]]
    kept = kept[: next((i for i, e in enumerate(kept) if e["file"] != _layers_name(i)), len(kept))]
    kv = StaticKV(target.model, 0, int(manifest["max_prompt_tokens"]) + int(manifest["max_new_tokens"]) + 1, pool=1)
    bar = tqdm(total=len(manifest["shards"]), initial=len(kept), desc="shards", unit="shard", disable=not progress)
    try:
        for i, shard in enumerate(read_shards(out, list(range(len(kept), len(manifest["shards"])))), start=len(kept)):
            starts = shard["starts"].tolist()
            states = {layer: [] for layer in layers}
            for a, b in zip(starts, starts[1:]):
                (row,) = kv.add(1)
                kv.forward([shard["tokens"][a:b].tolist()], 1, hidden_layers=tuple(layers), only=[row], hidden_all=True)
                for layer in layers:
                    states[layer].append(kv.hidden[layer][0, : b - a].to(torch.bfloat16))
                kv.select([])
            path = out / _layers_name(i)
            tmp = path.with_name(path.name + ".tmp")
            save_file({f"layer{layer}": torch.cat(s).contiguous() for layer, s in states.items()}, str(tmp))
            sha = file_sha256(tmp)
            os.replace(tmp, path)
            kept.append({"file": path.name, "sha256": sha})
            manifest["layers"] = {"layers": layers, "shards": kept}
            atomic_write(out / "manifest.json", json.dumps(manifest, indent=1) + "\n")
            bar.update(1)
            if minutes is not None and time.monotonic() - started >= 60 * minutes:
                break
    finally:
        bar.close()
    manifest["layers"] = {"layers": layers, "shards": kept}
    atomic_write(out / "manifest.json", json.dumps(manifest, indent=1) + "\n")
    return manifest
