"""Training Medusa or EAGLE heads on a data folder of the target's own features
(speclm.heads.data), with HF accelerate: one process here, several GPUs under `accelerate launch`.

The data: sequences (a chat-templated prompt + the target's greedy response) and, at each token,
the target's hidden state after its final norm. They are cut into windows of at most `chunk`
tokens (absolute positions kept), split into training and validation by a hash of each prompt's
id, and streamed from the shards a few at a time (a window's features are read from its shard
when its batch is made), shuffled within a buffer of a few shards by a generator seeded from
(seed, epoch): the data order is a function of the arguments alone.

A run folder (`out_dir`) holds:
- vocab_ids.json: the restricted vocabulary (the training responses' most frequent tokens, EOS
  always among them);
- checkpoint/: accelerate's state (weights, optimizer, scheduler, RNG states) and state.json
  (step, epoch, position in the data order, config, data_sha256, the plan), replaced atomically
  every `save_every` steps and at the end;
- metrics.jsonl: one line per 10 training steps and per validation; loss.png, acceptance.png;
- heads.safetensors: the trained heads (speclm.heads.store), written at the end of every run.

A run resumes from its checkpoint to the weights an uninterrupted run would have reached: the
plan (every argument that changes the weights, `steps` and `epochs` included, since they set the
learning-rate schedule) must be the same; `minutes` is a wall-clock stop, not part of the plan,
so a run stopped by it continues with another `minutes` budget.
"""

from __future__ import annotations

import hashlib
import json
import math
import shutil
import sys
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from speclm.files import atomic_write
from speclm.errors import UsageError
from speclm.heads.modules import IGNORE, KINDS, EagleHead, HeadsConfig, labels_in_vocab, make

DEFAULT_LR = {"medusa": 1e-3, "eagle": 3e-4}
DEFAULT_POSITIONS = {"medusa": "response", "eagle": "all"}  # which positions train (train's `positions`)
BUFFER_SHARDS = 4  # windows are shuffled within this many shards at a time
LOG_EVERY = 10  # training steps per line of metrics.jsonl
FLOOR = 0.1  # the cosine schedule ends at this fraction of the peak learning rate
VOCAB_FILE = "vocab_ids.json"
CHECKPOINT = "checkpoint"


# ---------------------------------------------------------------------------------------------
# the data


def is_validation(prompt_id, fraction: float) -> bool:
    """Whether a sequence whose prompt has this id is in the validation split: a hash of the id,
    so that every response to one prompt falls on the same side, in every run."""
    if fraction <= 0:
        return False
    digest = hashlib.sha256(json.dumps(prompt_id, sort_keys=True).encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2.0 ** 64 < fraction


@dataclass(frozen=True)
class Window:
    shard: int  # index into the manifest's shards
    seq: int  # sequence index within the shard
    start: int  # positions [start, end) of the sequence
    end: int


class Shards:
    """A data folder's (or several folders') index: every shard's tokens, sequence offsets, prompt lengths and split
    (small, held in memory); features are read a window at a time from the shards (memory-mapped)."""

    def __init__(self, data_dir, chunk: int, valid_fraction: float, open_files: int = 8, every: bool = False,
                 layers: tuple[int, ...] = ()):
        """data_dir: a data folder, or a list of them (their shards read as one set; they must come
        from the same target). every: every position trains (EAGLE: its targets, the next feature
        and the target's distribution there, are the target's own at a prompt token too), not only
        those whose next token the target generated. layers: decoder layers whose states batches
        also carry (`aux`), from the folders' layers files (speclm heads layers)."""
        dirs = [Path(d) for d in ([data_dir] if isinstance(data_dir, (str, Path)) else data_dir)]
        if not dirs:
            raise UsageError("no data folder given")
        self.every = every
        manifests = [self._manifest(d) for d in dirs]
        self.manifest = m = manifests[0]
        for d, other in zip(dirs[1:], manifests[1:]):
            differ = [k for k in ("target", "quantize", "hidden_size", "vocab_size") if other.get(k) != m.get(k)]
            if differ:
                raise UsageError(f"{d} and {dirs[0]} hold data of different targets ("
                                 + ", ".join(f"{k} {other.get(k)!r} vs {m.get(k)!r}" for k in differ) + ")")
        self.hidden_size, self.vocab_size = int(m["hidden_size"]), int(m["vocab_size"])
        hashes = [x.get("data_sha256") or hashlib.sha256(json.dumps([s.get("sha256") for s in x["shards"]]).encode()).hexdigest()
                  for x in manifests]
        # one folder: its own hash (checkpoints of earlier runs still match); several: a hash of theirs, in order
        self.data_sha256 = hashes[0] if len(hashes) == 1 else hashlib.sha256(json.dumps(hashes).encode()).hexdigest()
        self.files = [d / s["file"] for d, x in zip(dirs, manifests) for s in x["shards"]]
        self.layers = tuple(layers)
        self.layer_files = []
        for d, x in zip(dirs, manifests):
            if not layers:
                break
            stored = x.get("layers") or {}
            if not set(layers) <= set(stored.get("layers", ())) or len(stored.get("shards", ())) < len(x["shards"]):
                raise UsageError(f"{d} lacks the target's states at layers {','.join(map(str, layers))} for every shard: "
                                 f"run `speclm heads layers --data {d} --layers {','.join(map(str, layers))}`")
            self.layer_files += [d / e["file"] for e in stored["shards"][: len(x["shards"])]]
        self.tokens, self.starts, self.prompt_lens, self.valid = [], [], [], []
        self._open: OrderedDict[int, object] = OrderedDict()
        self._open_files = open_files
        from safetensors import safe_open

        for file in self.files:
            if not file.is_file():
                raise UsageError(f"{file.parent}: shard {file.name} is missing")
            with safe_open(str(file), framework="pt") as f:
                meta = f.metadata() or {}
                tokens, starts = f.get_tensor("tokens"), f.get_tensor("starts").long()
                prompt_lens = f.get_tensor("prompt_lens").long()
                rows, width = f.get_slice("hidden").get_shape()
            count = len(prompt_lens)
            if len(starts) != count + 1 or int(starts[-1]) != len(tokens) or rows != len(tokens):
                raise UsageError(f"{file}: tokens, starts, prompt_lens and hidden do not agree")
            if width != self.hidden_size:
                raise UsageError(f"{file}: hidden size {width}, the manifest says {self.hidden_size}")
            try:
                ids = json.loads(meta.get("prompt_ids", "null"))
            except ValueError:
                ids = None
            if not isinstance(ids, list) or len(ids) != count:  # no ids: the prompt's tokens name it
                ids = [tokens[int(starts[i]):int(starts[i]) + int(prompt_lens[i])].tolist() for i in range(count)]
            self.tokens.append(tokens)
            self.starts.append(starts)
            self.prompt_lens.append(prompt_lens)
            self.valid.append([is_validation(pid, valid_fraction) for pid in ids])
        self.chunk = chunk
        self.train_windows = [self._windows(s, False) for s in range(len(self.files))]  # per shard
        self.valid_windows = [w for s in range(len(self.files)) for w in self._windows(s, True)]

    @staticmethod
    def _manifest(folder: Path) -> dict:
        path = folder / "manifest.json"
        if not path.is_file():
            raise UsageError(f"'{folder}' is not a heads data folder (no manifest.json)")
        try:
            m = json.loads(path.read_text(encoding="utf-8"))
        except ValueError as exc:
            raise UsageError(f"{path}: not JSON ({exc})") from None
        if m.get("format") != 1:
            raise UsageError(f"{path}: format {m.get('format')!r}, this speclm reads format 1")
        if m.get("layer", -1) != -1:
            raise UsageError(f"{path}: features of layer {m['layer']}; heads read the last layer's (-1, after the final norm)")
        for key in ("hidden_size", "vocab_size", "shards"):
            if key not in m:
                raise UsageError(f"{path}: no '{key}'")
        return m

    def sequences(self, validation: bool) -> list[tuple[int, int]]:
        return [(s, i) for s, flags in enumerate(self.valid) for i, v in enumerate(flags) if v == validation]

    def _windows(self, shard: int, validation: bool) -> list[Window]:
        """The shard's windows of one split: each sequence cut every `chunk` tokens, keeping only
        windows with a position t (t + 1 in the window) whose next token the target generated."""
        out = []
        starts, prompt_lens = self.starts[shard].tolist(), self.prompt_lens[shard].tolist()
        for i, v in enumerate(self.valid[shard]):
            if v != validation:
                continue
            length = starts[i + 1] - starts[i]
            for a in range(0, length, self.chunk):
                b = min(a + self.chunk, length)
                if max(a, 0 if self.every else prompt_lens[i] - 1) < b - 1:
                    out.append(Window(shard, i, a, b))
        return out

    def response_counts(self) -> Counter:
        """How often each token is a training response token (positions >= the prompt's length)."""
        counts = torch.zeros(self.vocab_size, dtype=torch.long)
        for s, i in self.sequences(False):
            o, pl, end = int(self.starts[s][i]), int(self.prompt_lens[s][i]), int(self.starts[s][i + 1])
            response = self.tokens[s][o + pl:end].long()
            if len(response) and (int(response.max()) >= self.vocab_size or int(response.min()) < 0):
                raise UsageError(f"{self.files[s]}: token ids outside the vocabulary of {self.vocab_size}")
            counts += torch.bincount(response, minlength=self.vocab_size)
        nonzero = counts.nonzero().flatten()
        return Counter(dict(zip(nonzero.tolist(), counts[nonzero].tolist())))

    def epoch_order(self, seed: int, epoch: int, batch_size: int) -> list[list[Window]]:
        """The epoch's training batches: shards in a random order, the windows of each
        BUFFER_SHARDS consecutive ones shuffled together, cut into batches in that order."""
        g = torch.Generator().manual_seed(_mix(seed, epoch))
        shards = [s for s in torch.randperm(len(self.files), generator=g).tolist() if self.train_windows[s]]
        order: list[Window] = []
        for k in range(0, len(shards), BUFFER_SHARDS):
            pool = [w for s in shards[k:k + BUFFER_SHARDS] for w in self.train_windows[s]]
            order.extend(pool[j] for j in torch.randperm(len(pool), generator=g).tolist())
        return [order[k:k + batch_size] for k in range(0, len(order), batch_size)]

    def batches_per_epoch(self, batch_size: int) -> int:
        return math.ceil(sum(len(w) for w in self.train_windows) / batch_size)

    def validation_batches(self, batch_size: int) -> list[list[Window]]:
        w = self.valid_windows
        return [w[k:k + batch_size] for k in range(0, len(w), batch_size)]

    def _file(self, shard: int, layers: bool = False):
        from safetensors import safe_open

        key = (shard, layers)
        if key in self._open:
            self._open.move_to_end(key)
        else:
            self._open[key] = safe_open(str((self.layer_files if layers else self.files)[shard]), framework="pt")
            while len(self._open) > self._open_files:
                self._open.popitem(last=False)
        return self._open[key]

    def collate(self, windows: list[Window]) -> dict[str, torch.Tensor]:
        """Windows -> a padded batch (CPU): tokens, positions (B, L) long, features (B, L, E) fp32,
        mask (B, L) (position >= prompt length - 1: the target generated the next token; False on
        padding), pad (B, L) bool (True on padding); with layers, aux (B, L, len(layers) E) fp32."""
        width = max(w.end - w.start for w in windows)
        n = len(windows)
        tokens = torch.zeros(n, width, dtype=torch.long)
        positions = torch.zeros(n, width, dtype=torch.long)
        features = torch.zeros(n, width, self.hidden_size, dtype=torch.float32)
        mask = torch.zeros(n, width, dtype=torch.bool)
        pad = torch.ones(n, width, dtype=torch.bool)
        e = self.hidden_size
        aux = torch.zeros(n, width, len(self.layers) * e, dtype=torch.float32) if self.layers else None
        for r, w in enumerate(windows):
            o = int(self.starts[w.shard][w.seq])
            length = w.end - w.start
            tokens[r, :length] = self.tokens[w.shard][o + w.start:o + w.end].long()
            features[r, :length] = self._file(w.shard).get_slice("hidden")[o + w.start:o + w.end].float()
            for j, layer in enumerate(self.layers):
                aux[r, :length, j * e:(j + 1) * e] = \
                    self._file(w.shard, True).get_slice(f"layer{layer}")[o + w.start:o + w.end].float()
            positions[r] = torch.arange(w.start, w.start + width)
            first = 0 if self.every else int(self.prompt_lens[w.shard][w.seq]) - 1
            mask[r, :length] = positions[r, :length] >= first
            pad[r, :length] = False
        batch = {"tokens": tokens, "positions": positions, "features": features, "mask": mask, "pad": pad}
        if aux is not None:
            batch["aux"] = aux
        return batch


def _mix(seed: int, epoch: int) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}:{epoch}".encode()).digest()[:8], "big") >> 1


# ---------------------------------------------------------------------------------------------
# the model


class _Objective(nn.Module):
    """The heads and their loss in one module, so that accelerate's wrappers (DDP's gradient
    synchronisation, autocast) see the loss computed in a forward."""

    def __init__(self, heads: nn.Module, frozen, unroll: int = 1):
        super().__init__()
        self.heads = heads
        self.frozen = frozen  # not a module: never trained, never saved
        self.unroll = unroll

    def forward(self, tokens, features, positions, mask, labels, aux=None):
        if isinstance(self.heads, EagleHead):
            return self.heads.loss(self.frozen, labels, features, mask, tokens, positions, unroll=self.unroll, aux=aux)
        return self.heads.loss(self.frozen, labels, features, mask)


def _target_config(target) -> dict:
    cfg = target.model.config
    cfg = getattr(cfg, "text_config", None) or cfg
    heads = cfg.num_attention_heads
    theta = getattr(cfg, "rope_theta", None)
    if theta is None:
        params = getattr(cfg, "rope_parameters", None) or {}
        theta = params.get("rope_theta")
        if theta is None:  # per layer type: the full-attention layers'
            nested = [v for v in params.values() if isinstance(v, dict) and "rope_theta" in v]
            theta = (params.get("full_attention") or (nested[0] if nested else {})).get("rope_theta", 10000.0)
    return {
        "hidden_size": cfg.hidden_size,
        "num_heads": heads,
        "kv_heads": getattr(cfg, "num_key_value_heads", None) or heads,
        "head_dim": getattr(cfg, "head_dim", None) or cfg.hidden_size // heads,
        "rope_theta": float(theta),
        "eps": float(getattr(cfg, "rms_norm_eps", 1e-6)),
        "layers": int(cfg.num_hidden_layers),
    }


def _frozen_on(target, ids: torch.Tensor, device):
    """frozen_parts' output-head rows and embedding, on the training device."""
    from speclm.heads.vocab import frozen_parts

    frozen = frozen_parts(target, ids)
    frozen.head = frozen.head.to(device)
    embed = target.model.get_input_embeddings()
    if isinstance(embed, nn.Embedding):
        weight = embed.weight.detach().to(device=device, dtype=torch.float32)
        scale = getattr(embed, "embed_scale", None)  # Gemma's scaled embedding module: rows times sqrt(hidden)
        scale = None if scale is None else scale.detach().to(device=device, dtype=torch.float32)

        def lookup(tokens: torch.Tensor) -> torch.Tensor:
            rows = nn.functional.embedding(tokens.to(device), weight)
            return rows if scale is None else rows * scale
    else:
        # speclm's PackedEmbedding (a table kept as GGUF blocks) has a device but no parameters
        base, source = frozen.embed, getattr(embed, "device", torch.device("cpu"))

        def lookup(tokens: torch.Tensor) -> torch.Tensor:
            return base(tokens.to(source)).to(device)
    frozen.embed = lookup
    return frozen


def _factor(step: int, warmup: int, total: int | None) -> float:
    """Learning rate / peak before optimizer step `step` + 1: linear warmup, then a cosine to
    FLOOR at `total` (no total, `minutes` alone: constant after the warmup)."""
    if step < warmup:
        return (step + 1) / warmup
    if total is None:
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return FLOOR + (1 - FLOOR) * 0.5 * (1 + math.cos(math.pi * progress))


# ---------------------------------------------------------------------------------------------
# the run folder


def _checkpoint_dir(out: Path) -> Path | None:
    """The run's checkpoint, or the previous one where a save died between its two renames."""
    for name in (CHECKPOINT, CHECKPOINT + ".old"):
        if (out / name / "state.json").is_file():
            return out / name
    return None


def checkpoint_state(checkpoint: Path, out: Path, plan: dict, data_sha256: str) -> dict:
    """The state.json of a run's checkpoint, which a resumed run continues; UsageError where it was
    trained on other data or with another plan (every argument that changes the weights)."""
    state = json.loads((checkpoint / "state.json").read_text(encoding="utf-8"))
    if state.get("data_sha256") != data_sha256:
        raise UsageError(f"the checkpoint in {out} was trained on other data (data_sha256 {state.get('data_sha256')}, "
                         f"this data's {data_sha256}): use another output folder, or --no-resume to start over")
    changed = [k for k in {**state.get("plan", {}), **plan} if state.get("plan", {}).get(k) != plan.get(k)]
    if changed:
        was = ", ".join(f"{k} {state.get('plan', {}).get(k)!r} -> {plan.get(k)!r}" for k in changed)
        raise UsageError(f"the checkpoint in {out} was trained with other arguments ({was}): give the same ones "
                         "to resume it, or use another output folder, or --no-resume to start over")
    return state


def replace_checkpoint(out: Path, tmp: Path) -> None:
    """Make the complete checkpoint folder `tmp` the run's checkpoint: the current one is renamed
    to .old first and removed last, so a crash in between leaves one that _checkpoint_dir finds."""
    current, old = out / CHECKPOINT, out / (CHECKPOINT + ".old")
    shutil.rmtree(old, ignore_errors=True)
    if current.exists():
        current.rename(old)
    tmp.rename(current)
    shutil.rmtree(old, ignore_errors=True)


def _keep_metrics_until(path: Path, step: int) -> None:
    """Drop the lines of steps after a resumed checkpoint's: the resumed run writes them again."""
    if not path.is_file():
        return
    kept = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            if json.loads(line)["step"] <= step:
                kept.append(line)
        except (ValueError, KeyError, TypeError):
            continue
    atomic_write(path, "".join(k + "\n" for k in kept))


def _append(path: Path, record: dict) -> None:
    with path.open("a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")


# ---------------------------------------------------------------------------------------------
# training


def train(data_dir, out_dir, kind: str, target, *, vocab: int = 16384, heads: int = 4, intermediate: int = 2048,
          chunk: int = 256, batch_size: int = 8, lr: float | None = None, weight_decay: float = 0.0,
          warmup: int = 50, steps: int | None = None, epochs: float | None = None, minutes: float | None = None,
          eval_every: int = 100, save_every: int = 200, seed: int = 0, valid_fraction: float = 0.05,
          resume: bool = True, progress: bool = True, mixed_precision: str = "no",
          command: list[str] | None = None, positions: str | None = None, init=None, unroll: int = 1,
          fuse_layers: tuple[int, ...] = ()) -> dict:
    """Train `kind` heads (medusa | eagle) for `target` (a catalog name or model folder, loaded
    with the data's quantization, or a LoadedModel) on the data folder `data_dir`; write the run
    folder `out_dir` (see the module's docstring) and return a summary. Stops at `steps`, after
    `epochs` passes over the training split, or after `minutes` of wall time, whichever first;
    the learning rate warms up over `warmup` steps, then follows a cosine to 10% at the end of
    `steps`/`epochs` (constant with `minutes` alone). `command`: the command line, recorded in
    the heads' file. positions: "response" (the positions whose next token the target generated)
    or "all" (prompt tokens too: EAGLE's targets are the target's own features and distribution
    there); None: all for eagle, response for medusa (its labels are the tokens themselves).
    data_dir: a data folder or a list of them. init: a heads file (speclm.heads.store) whose
    weights the run starts from instead of a fresh initialisation (same kind and shape; its
    vocabulary is not reused: neither kind has weights tied to the vocabulary, which comes from
    this run's data). unroll: eagle, the levels trained with the head's own predictions fed back
    (EagleHead.loss; 1: the real features alone). fuse_layers: eagle, decoder layers whose states
    join the final feature as its input (EAGLE-3's fused features; the data needs them: speclm
    heads layers); from an --init file without them, the run starts as that head exactly (its
    `reduce` passes the final feature through)."""
    from accelerate import Accelerator
    from accelerate.utils import DistributedDataParallelKwargs, set_seed

    started = time.monotonic()
    if kind not in KINDS:
        raise UsageError(f"unknown kind of heads '{kind}' (choose from {', '.join(KINDS)})")
    if steps is None and epochs is None and minutes is None:
        raise UsageError("give a budget: steps, epochs or minutes")
    for name, value, low in (("vocab", vocab, 1), ("heads", heads, 1), ("intermediate", intermediate, 1),
                             ("chunk", chunk, 3), ("batch_size", batch_size, 1), ("eval_every", eval_every, 1),
                             ("save_every", save_every, 1), ("warmup", warmup, 0), ("unroll", unroll, 1)):
        if value < low:
            raise UsageError(f"{name} must be >= {low}, got {value}")
    if steps is not None and steps < 1 or epochs is not None and epochs <= 0 or minutes is not None and minutes < 0:
        raise UsageError("steps and epochs must be positive, minutes not negative")
    if not 0 <= valid_fraction < 1:
        raise UsageError(f"valid_fraction must be in [0, 1), got {valid_fraction}")
    if mixed_precision not in ("no", "bf16"):
        raise UsageError(f"mixed_precision must be 'no' or 'bf16', not '{mixed_precision}'")
    lr = DEFAULT_LR[kind] if lr is None else lr
    positions = positions or DEFAULT_POSITIONS[kind]
    if positions not in ("response", "all"):
        raise UsageError(f"positions must be response or all, not '{positions}'")

    init_sha = None
    if init is not None:
        from speclm.models.store import file_sha256

        if not Path(init).is_file():
            raise UsageError(f"--init {init}: no such heads file")
        init_sha = file_sha256(Path(init))
    fuse_layers = tuple(sorted(set(int(x) for x in fuse_layers)))
    if fuse_layers and kind != "eagle":
        raise UsageError("fuse layers are for eagle heads")
    data = Shards(data_dir, chunk, valid_fraction, every=positions == "all", layers=fuse_layers)
    if isinstance(target, (str, Path)):
        from speclm.models.loading import load_model

        target = load_model(str(target), quantize=data.manifest.get("quantize", "none"), progress=progress)
    shape = _target_config(target)
    if data.hidden_size != shape["hidden_size"]:
        raise UsageError(f"the data in {data_dir} has hidden size {data.hidden_size} but the target '{target.name}' "
                         f"has {shape['hidden_size']}: the data was made with another model")
    if data.vocab_size != target.vocab_size:
        raise UsageError(f"the data in {data_dir} has vocabulary size {data.vocab_size} but the target "
                         f"'{target.name}' has {target.vocab_size}: the data was made with another model")
    train_batches = data.batches_per_epoch(batch_size)
    if not train_batches:
        raise UsageError(f"no training data in {data_dir}: every sequence is in the validation split "
                         f"(valid_fraction {valid_fraction}) or has no response")

    # a Medusa head can get no loss in a batch (windows too short for its depth): DDP must allow it
    accelerator = Accelerator(cpu=not torch.cuda.is_available(), mixed_precision=mixed_precision,
                              kwargs_handlers=[DistributedDataParallelKwargs(find_unused_parameters=True)])
    main, procs, rank = accelerator.is_main_process, accelerator.num_processes, accelerator.process_index
    device = accelerator.device
    per_epoch = math.ceil(train_batches / procs)  # optimizer steps per epoch (procs batches each)
    totals = [t for t in (steps, None if epochs is None else max(1, math.ceil(epochs * per_epoch))) if t is not None]
    total = min(totals) if totals else None
    plan = {"kind": kind, "target": target.name, "vocab": vocab, "heads": heads, "intermediate": intermediate,
            "chunk": chunk, "batch_size": batch_size, "lr": lr, "weight_decay": weight_decay, "warmup": warmup,
            "steps": steps, "epochs": epochs, "seed": seed, "valid_fraction": valid_fraction,
            "mixed_precision": mixed_precision, "processes": procs, "positions": positions}
    # only where given: the plans of runs without them stay as they were
    if init_sha is not None:
        plan["init"] = init_sha
    if kind == "eagle" and unroll != 1:
        plan["unroll"] = unroll
    if fuse_layers:
        plan["fuse_layers"] = list(fuse_layers)

    out = Path(out_dir)
    metrics_path = out / "metrics.jsonl"
    checkpoint = _checkpoint_dir(out) if resume else None
    state = None if checkpoint is None else checkpoint_state(checkpoint, out, plan, data.data_sha256)
    if main:
        out.mkdir(parents=True, exist_ok=True)
        if state is None:  # a fresh run: nothing of an earlier one stays
            for name in (CHECKPOINT, CHECKPOINT + ".old", CHECKPOINT + ".tmp"):
                shutil.rmtree(out / name, ignore_errors=True)
            metrics_path.unlink(missing_ok=True)
    accelerator.wait_for_everyone()

    # the restricted vocabulary
    if state is not None:
        try:
            ids = torch.tensor(json.loads((out / state["vocab_file"]).read_text(encoding="utf-8")), dtype=torch.long)
        except (OSError, ValueError, KeyError) as exc:
            raise UsageError(f"the checkpoint in {out} has no readable vocabulary file ({exc}): --no-resume to start over") from None
    else:
        from speclm.heads.vocab import frequent_tokens

        ids = frequent_tokens(data.response_counts(), vocab, always=tuple(target.eos_token_ids))
        if main:
            atomic_write(out / VOCAB_FILE, json.dumps(ids.tolist()))

    config = HeadsConfig(kind=kind, hidden_size=data.hidden_size, vocab=len(ids), target_vocab_size=data.vocab_size,
                         target=target.name, heads=heads, num_heads=shape["num_heads"], kv_heads=shape["kv_heads"],
                         head_dim=shape["head_dim"], intermediate=intermediate, rope_theta=shape["rope_theta"],
                         eps=shape["eps"], fuse_layers=fuse_layers)
    if any(not 0 <= layer < shape["layers"] for layer in fuse_layers):
        raise UsageError(f"fuse layers must be decoder layer indices in 0..{shape['layers'] - 1}, got {list(fuse_layers)}")
    set_seed(seed)
    heads_module = make(config)
    if init is not None:
        from speclm.heads.store import load

        start = load(init, target)[0].state_dict()
        want = heads_module.state_dict()
        if "reduce.weight" in want and "reduce.weight" not in start:  # a head without fuse layers: reduce passes through
            start["reduce.weight"] = want["reduce.weight"]
        differ = [k for k in {**start, **want} if k not in start or k not in want or start[k].shape != want[k].shape]
        if differ:
            raise UsageError(f"--init {init} holds heads of another shape ("
                             + ", ".join(f"{k} {tuple(start[k].shape) if k in start else None} vs "
                                         f"{tuple(want[k].shape) if k in want else None}" for k in differ[:3]) + ")")
        heads_module.load_state_dict(start)
    objective = _Objective(heads_module, _frozen_on(target, ids, device), unroll if kind == "eagle" else 1)
    optimizer = torch.optim.AdamW(objective.heads.parameters(), lr=lr, weight_decay=weight_decay)
    # accelerate steps a prepared scheduler once per process per optimizer step
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda tick: _factor(tick // procs, warmup, total))
    model, optimizer, scheduler = accelerator.prepare(objective, optimizer, scheduler)
    set_seed(seed, device_specific=True)  # EAGLE's training noise: another draw on each process
    step, seconds_before, last_eval = 0, 0.0, {}
    if state is not None:
        accelerator.load_state(str(checkpoint))  # weights, optimizer, scheduler and RNG states
        step, seconds_before, last_eval = int(state["step"]), float(state["seconds"]), state.get("validation") or {}
        if main:
            _keep_metrics_until(metrics_path, step)
    accelerator.wait_for_everyone()

    def seconds() -> float:
        return seconds_before + time.monotonic() - started

    def to_device(windows: list[Window]) -> tuple[dict, int]:
        batch = data.collate(windows)
        labels = labels_in_vocab(batch["tokens"], ids, data.vocab_size).masked_fill(batch["pad"], IGNORE)
        count = int((~batch.pop("pad")).sum())
        batch["labels"] = labels
        return {k: v.to(device, non_blocking=True) for k, v in batch.items()}, count

    valid_batches = data.validation_batches(batch_size)

    def evaluate() -> dict:
        from accelerate.utils import gather_object

        inner = accelerator.unwrap_model(model)
        inner.eval()
        sums: dict[str, float] = {}
        weights: dict[str, float] = {}
        with torch.no_grad():
            for windows in valid_batches[rank::procs]:
                batch, _ = to_device(windows)
                loss, metrics = inner(**batch)
                w = float(batch["mask"].sum())
                for k, v in {"loss": loss.item(), **metrics}.items():
                    sums[k] = sums.get(k, 0.0) + w * v
                    weights[k] = weights.get(k, 0.0) + w
        model.train()
        gathered = gather_object([(sums, weights)]) if procs > 1 else [(sums, weights)]
        total_sums: dict[str, float] = {}
        total_weights: dict[str, float] = {}
        for s, w in gathered:
            for k in s:
                total_sums[k] = total_sums.get(k, 0.0) + s[k]
                total_weights[k] = total_weights.get(k, 0.0) + w[k]
        return {k: total_sums[k] / total_weights[k] for k in sorted(total_sums) if total_weights[k] > 0}

    def validate() -> None:
        nonlocal last_eval
        result = evaluate()
        if not result:
            return
        last_eval = result
        if main:
            _append(metrics_path, {"step": step, "split": "validation", "seconds": round(seconds(), 3), **result})
            from speclm.heads.plots import plot_run

            plot_run(out)

    def save() -> None:
        tmp = out / (CHECKPOINT + ".tmp")
        if main:
            shutil.rmtree(tmp, ignore_errors=True)
        accelerator.wait_for_everyone()
        accelerator.save_state(str(tmp))
        accelerator.wait_for_everyone()
        if main:
            epoch, index = divmod(step, per_epoch)
            record = {"step": step, "epoch": epoch, "epoch_step": index, "steps_per_epoch": per_epoch,
                      "seconds": seconds(), "vocab_file": VOCAB_FILE, "config": config.to_dict(),
                      "data_sha256": data.data_sha256, "plan": plan, "validation": last_eval}
            (tmp / "state.json").write_text(json.dumps(record, indent=1), encoding="utf-8")
            replace_checkpoint(out, tmp)
        accelerator.wait_for_everyone()

    from tqdm.auto import tqdm

    bar = tqdm(total=total, initial=step, unit="step", desc=f"{kind} heads", disable=not (progress and main),
               dynamic_ncols=True)
    model.train()
    order_epoch, order = None, []
    window_sums: dict[str, float] = {}
    window_steps = 0
    saved, evaluated, stopped = (step if state is not None else None), None, "steps"
    try:
        while total is None or step < total:
            t0 = time.monotonic()
            epoch, index = divmod(step, per_epoch)
            if epoch != order_epoch:
                order, order_epoch = data.epoch_order(seed, epoch, batch_size), epoch
            batch, count = to_device(order[(index * procs + rank) % len(order)])
            loss, metrics = model(**batch)
            accelerator.backward(loss)
            accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            value = loss.item()
            rate = count * procs / max(time.monotonic() - t0, 1e-9)
            for k, v in {"loss": value, **metrics, "tokens_per_s": rate}.items():
                window_sums[k] = window_sums.get(k, 0.0) + v
            window_steps += 1
            bar.update(1)
            bar.set_postfix(loss=f"{value:.4f}", tok_s=f"{rate:.0f}")
            if step % LOG_EVERY == 0:
                if main:
                    record = {k: v / window_steps for k, v in window_sums.items()}
                    _append(metrics_path, {"step": step, "split": "train", "seconds": round(seconds(), 3),
                                           "lr": scheduler.get_last_lr()[0], "epoch": step / per_epoch, **record})
                window_sums, window_steps = {}, 0
            if step % eval_every == 0:
                validate()
                evaluated = step
            if step % save_every == 0:
                save()
                saved = step
            if minutes is not None and time.monotonic() - started >= minutes * 60:
                stopped = "minutes"
                break
        else:
            stopped = "steps" if steps is not None and total == steps else "epochs"
    finally:
        bar.close()
    if evaluated != step:
        validate()
    if saved != step:
        save()
    elapsed = seconds()
    path = out / "heads.safetensors"
    if main:
        from speclm.heads.plots import plot_run
        from speclm.heads.store import export

        plot_run(out)
        info = {"kind": kind, "steps": step, "seconds": round(elapsed, 3), "data_sha256": data.data_sha256,
                "command": list(command) if command is not None else None, "validation": last_eval}
        export(path, accelerator.unwrap_model(model).heads, config, ids, info)
    accelerator.wait_for_everyone()
    return {"out_dir": str(out), "heads": str(path), "kind": kind, "steps": step, "epochs": step / per_epoch,
            "total_steps": total, "stopped": stopped, "seconds": elapsed, "vocab": len(ids),
            "train_sequences": len(data.sequences(False)), "validation_sequences": len(data.sequences(True)),
            "validation": last_eval}


# ---------------------------------------------------------------------------------------------
# the command line


def run(args) -> int:
    """`speclm heads train`: train, print the summary as JSON, exit status 0."""
    from speclm.runtime import set_threads

    set_threads(args.threads)
    target = args.target
    if target is None:
        manifest = Path(args.data[0]) / "manifest.json"
        try:
            target = json.loads(manifest.read_text(encoding="utf-8"))["target"]
        except (OSError, ValueError, KeyError):
            raise UsageError(f"no target named in {manifest}: give --target") from None
    summary = train(args.data, args.out, args.kind, target, vocab=args.vocab, heads=args.heads,
                    intermediate=args.intermediate, chunk=args.chunk, batch_size=args.batch_size, lr=args.lr,
                    weight_decay=args.weight_decay, warmup=args.warmup, steps=args.steps, epochs=args.epochs,
                    minutes=args.minutes, eval_every=args.eval_every, save_every=args.save_every, seed=args.seed,
                    valid_fraction=args.valid_fraction, resume=args.resume, progress=sys.stderr.isatty(),
                    mixed_precision=args.mixed_precision, command=["speclm"] + sys.argv[1:],
                    positions=args.positions, init=args.init, unroll=args.unroll, fuse_layers=args.fuse_layers or ())
    print(json.dumps(summary, indent=1))
    return 0
