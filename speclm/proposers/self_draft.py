"""Self-speculation: the target drafts for itself with a subset of its own layers (early exit: the
first L layers; layer skipping: every layer but a skip set, as Draft&Verify and SWIFT do), then
its final norm and output head. No second model, no second prefill.

The draft runs on the target's own KV cache: in the layers it runs, a drafted token attends the
keys and values the target computed for the committed tokens, and it writes keys and values only
at the drafted positions, past the committed ones; those are rolled back before the proposal
returns, and the verification forward writes those slots again with every layer. Greedy
drafts take the argmax; sampled drafts draw from the subset's processed distribution with the
request's own generator, and the verifier's rejection sampling keeps the output exactly the
target's either way. A round drafts a chain (a drafting forward per token) or, given a TreeSpec,
a tree grown as a draft model's is (speclm.proposers.draft_tree.grow, a level per forward); the
head may score a restricted vocabulary (speclm.proposers.draft_vocab), as a draft model's does.

Which layers draft (`--layers`): "N" (the first N), "skip:I,J-K" ('+' also separates, for the
bench's method syntax), or "auto": the candidates below, each run on a few fixed calibration
prompts on this machine, the fastest kept per model, weights, thread count and kernel build in
`$SPECLM_HOME/self-layers/` (measured once, before the first request that needs it).
"""

from __future__ import annotations

import json
import re
import sys
import time
from dataclasses import dataclass

import torch

from speclm.errors import UsageError
from speclm.files import atomic_write
from speclm.proposers.base import Draft, Proposer
from speclm.proposers.draft_tree import DraftTimes, TreeSpec, grow, record_acceptance
from speclm.proposers.draft_vocab import RowVocabs, on_vocabulary, token_of
from speclm.quant.weights import QuantLinear
from speclm.sampling import SamplingParams, processed_probs, sample

# calibration prompts: not evaluation prompts (no Spec-Bench text)
CALIBRATION = (
    "Write a Python function that returns the n-th Fibonacci number, with a docstring.",
    "Explain in three sentences why the sky looks blue during the day.",
)
CALIBRATION_TOKENS = 32


@dataclass(frozen=True)
class LayerChoice:
    kind: str  # "auto", "all", "first" or "skip"
    first: int = 0  # "first": how many
    skip: tuple[int, ...] = ()  # "skip": which


def parse_layers(text: str) -> LayerChoice:
    """--layers: "auto", "all", "N" or "skip:I,J-K"; a UsageError that says the form otherwise."""
    text = text.strip()
    if text in ("auto", "all"):
        return LayerChoice(text)
    if text.isdigit():
        if int(text) < 1:
            raise UsageError("--layers N needs N >= 1")
        return LayerChoice("first", first=int(text))
    if text.startswith("skip:"):
        skip: set[int] = set()
        for part in filter(None, re.split(r"[,+]", text[5:])):
            lo, dash, hi = part.partition("-")
            if not lo.isdigit() or (dash and not hi.isdigit()):
                raise UsageError(f"--layers skip: expects layer indices and ranges such as skip:3,5-9, got '{text}'")
            skip.update(range(int(lo), int(hi if dash else lo) + 1))
        if not skip:
            raise UsageError("--layers skip: names no layer")
        return LayerChoice("skip", skip=tuple(sorted(skip)))
    raise UsageError(f"--layers: auto, all (an int4 copy's), N (the first N layers) or skip:I,J-K, got '{text}'")


def layers_of(choice: LayerChoice, count: int) -> tuple[int, ...]:
    """The layers that run for a fixed choice on a model of `count` layers."""
    if choice.kind == "all":
        return tuple(range(count))
    if choice.kind == "first":
        if choice.first >= count:
            raise UsageError(f"--layers {choice.first}: the target has {count} layers; a draft needs fewer")
        return tuple(range(choice.first))
    if max(choice.skip) >= count:
        raise UsageError(f"--layers skip: layer {max(choice.skip)} does not exist (the target has {count})")
    kept = tuple(i for i in range(count) if i not in set(choice.skip))
    if not kept:
        raise UsageError("--layers skip: every layer skipped")
    return kept


def candidates(count: int, weights: str = "target") -> dict[str, tuple[int, ...]]:
    """The calibration's candidates for a model of `count` layers: by name, the layers that run;
    on an int4 copy every layer too (the whole target, in int4)."""
    quarter, half = max(1, count // 4), max(1, count // 2)
    every_other = tuple(range(2, count - 1, 2))  # about half, the first two and the last kept
    middle_other = tuple(range(quarter + 1, count - quarter, 2))  # about a quarter, in the middle
    middle = tuple(range(quarter, count - quarter))  # the middle half
    out = {f"first {half}": tuple(range(half)),
           "skip every other": tuple(i for i in range(count) if i not in every_other),
           "skip every other middle": tuple(i for i in range(count) if i not in middle_other),
           "skip the middle half": tuple(i for i in range(count) if i not in middle)}
    out = {name: kept for name, kept in out.items() if 0 < len(kept) < count}
    return out if weights == "target" else {"every layer": tuple(range(count)), **out}


def resolve_layers(choice: LayerChoice, engine, weights: str = "target") -> tuple[int, ...]:
    """The layers that draft: a fixed choice's, or (auto) the calibrated choice for this engine's
    target on this machine and these drafting weights ("target", "int4"), measured once and cached."""
    from speclm.forward import lean

    model = engine.target.model
    if not lean.supports(model):
        raise UsageError("method 'self' needs speclm's lean forward (Llama or Qwen2 architectures)")
    count = len(model.model.layers)
    if choice.kind != "auto":
        return layers_of(choice, count)
    from speclm.forward.costs import cache_path

    suffix = "" if weights == "target" else f"-{weights}-copy"
    path = cache_path("self-layers", f"{engine.target.name}-{engine.target.quantize}{suffix}", model)
    options = candidates(count, weights)
    try:
        saved = json.loads(path.read_text())
        if set(saved["measured"]) == {"none", *options}:  # a calibration over other candidates is done again
            return tuple(int(i) for i in saved["layers"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    layers, report = calibrate(engine, options, weights)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, json.dumps({"layers": list(layers), "measured": report}, indent=1))
    except OSError:
        pass  # an unwritable home: calibrated again next time
    return layers


def calibrate(engine, options: dict[str, tuple[int, ...]], weights: str = "target") -> tuple[tuple[int, ...], dict]:
    """Each candidate drafting greedily on CALIBRATION, timed against plain decoding; the fastest
    candidate's layers and every candidate's tokens/s."""
    from tqdm.auto import tqdm

    print("speclm: calibrating which of the target's layers draft for 'self' (once per model and machine, "
          "a few minutes)...", file=sys.stderr, flush=True)
    report: dict = {}

    def rate(**kwargs) -> float:
        from speclm.options import GenerationOptions

        engine.prepare(GenerationOptions(**kwargs))  # what the method makes once (an int4 copy) is not timed
        tokens, seconds = 0, 0.0
        for prompt in CALIBRATION:
            t0 = time.perf_counter()
            out = engine.generate(prompt, max_new_tokens=CALIBRATION_TOKENS, chat=bool(
                getattr(engine.target.tokenizer, "chat_template", None)), ignore_eos=True, **kwargs)
            seconds += time.perf_counter() - t0
            tokens += len(out.token_ids)
        return tokens / max(seconds, 1e-9)

    count = len(engine.target.model.model.layers)
    # the calibration's prompts leave the prefix caches as they were (a request's cached tokens are its own)
    saved = [list(cache.entries) for cache in (engine.prefix.target, engine.prefix.draft)]
    bar = tqdm(total=len(options) + 1, desc="self layers", unit="run", file=sys.stderr)
    report["none"] = rate(method="none")
    bar.update()
    best, best_rate = None, -1.0
    for name, kept in options.items():
        skipped = ",".join(str(i) for i in range(count) if i not in set(kept))
        report[name] = rate(method="self", layers=f"skip:{skipped}" if skipped else "all", self_weights=weights)
        bar.update()
        if report[name] > best_rate:
            best, best_rate = kept, report[name]
    bar.close()
    engine.prefix.target.entries[:], engine.prefix.draft.entries[:] = saved
    return best, {name: round(v, 3) for name, v in report.items()}


class SelfDraftProposer(Proposer):
    name = "self"
    runs_model = True
    drafts_on_target = True

    def __init__(self, model, layers, k: int, head=None, tree: TreeSpec | None = None,
                 times: DraftTimes | None = None, vocab: int = 0, always: tuple[int, ...] = ()):
        """model: the target (its lean forward runs the layers); layers: a speclm.forward.lean.Stack,
        the layers that draft (ascending) and their stand-ins (an int4 copy; none: the target's own);
        head: the output head's stand-in, a linear layer (an int4 copy; None: the target's own);
        tree: draft a tree of this shape each round instead of a chain (speclm.proposers.draft_tree;
        k is then its depth); times: the drafting forwards' measured times and the target's
        acceptance by rank, kept across requests, which greedy auto trees are grown by; vocab: the
        head scores only the `vocab` lowest ids, each row's prompt tokens and `always` (0: every id;
        speclm.proposers.draft_vocab), as a draft model's does."""
        from speclm.forward import lean

        if not lean.supports(model):
            raise UsageError("method 'self' needs speclm's lean forward (Llama or Qwen2 architectures)")
        if not layers.indices:
            raise UsageError("method 'self' needs at least one layer to draft with")
        self.model, self.layers, self.tree = model, layers, tree
        self.full_head = head  # a stand-in's (R, E) -> (R, V), or None: the target's own
        if isinstance(head, QuantLinear):
            self.full_head = head.rows
        self.vocab, self.always, self._head_module = vocab, tuple(always), head
        self.vocabs = RowVocabs(model, vocab, self.always, head=head)
        self.k, self.max_nodes = (k, k) if tree is None else (tree.max_depth, tree.max_nodes)
        self.shape = "chain" if tree is None else "tree"
        self._times = times if times is not None else DraftTimes()
        self._nodes: dict[int, list] = {}  # batch row -> the last greedy tree's nodes (for measuring acceptance)
        self.kv = None
        self.rows: list[int] = []
        self._seconds = 0.0

    def start(self, batch_size: int, capacity: int, prompt_lengths=None, max_new_tokens=None, pool: int = 0) -> None:
        self.vocabs = RowVocabs(self.model, self.vocab, self.always, head=self._head_module)
        self.add(batch_size)

    def add(self, count: int, prompt_lengths=None, max_new_tokens=None) -> None:
        self.vocabs.add(count)

    def select(self, rows: list[int]) -> None:
        self.vocabs.select(rows)
        self._nodes = {}

    def bind_target(self, kv, rows) -> None:
        self.kv, self.rows = kv, list(rows)

    @property
    def forward_seconds(self) -> float:
        return self._seconds

    @property
    def _head(self):
        """The head the drafting forwards end with: the restricted one where rows restrict it."""
        return self.vocabs.head if self.vocabs.head is not None else self.full_head

    def propose(self, contexts, max_tokens, params: SamplingParams, generators) -> Draft:
        batch, kv = len(contexts), self.kv
        drafting = [i for i in range(batch) if max_tokens[i] > 0]
        if not drafting:
            return Draft.empty(batch)
        t0 = time.perf_counter()
        new = [i for i in drafting if self.vocabs.ids[i] is None]
        if new:  # rows drafting for the first time: their vocabularies from their prompts
            self.vocabs.read(new, [contexts[i] for i in new])
        lengths = kv.lengths_list()
        start = [lengths[self.rows[i]] for i in drafting]  # committed slots, kept
        feed = [contexts[i][s:] for i, s in zip(drafting, start)]  # normally the target's last token
        only = [self.rows[i] for i in drafting]
        # the drafting rows' logits over the head's columns (all V ids, or vocabs.head.ids)
        t1 = time.perf_counter()  # a step's time, without building a restricted head
        logits = kv.forward(feed, 1, only=only, layers=self.layers, head=self._head)[:, -1]  # (D, S)
        if all(len(f) == 1 for f in feed):
            self._times.steps.record(1, time.perf_counter() - t1)
        vocab_size = self.vocabs.head.vocab_size if self.vocabs.head is not None else logits.shape[-1]
        budgets = [max_tokens[i] for i in drafting]
        gens = [generators[i] for i in drafting]
        if self.tree is not None:
            lengths = [s + len(f) for s, f in zip(start, feed)]
            grown = grow(_OnLayers(kv, self.layers, self._head), self.vocabs, drafting, vocab_size, self.tree, logits,
                         lengths, budgets, params, gens, t0, self._times, only,
                         [self.guides[i] if len(self.guides) > i else None for i in drafting])
            self._nodes = dict(zip(drafting, grown.nodes)) if params.greedy else {}
            draft = Draft(grown.tokens, grown.lengths, grown.probs, forwards=1 + grown.forwards,
                          forward_rows=len(drafting), parents=grown.parents)
        else:
            draft = self._chain(logits, drafting, only, budgets, vocab_size, params, gens)
        keep = kv.lengths_list()
        for row, s in zip(only, start):  # the drafted slots are the verification's to write
            keep[row] = s
        kv.truncate(keep)
        self._seconds += time.perf_counter() - t0
        return draft if len(drafting) == batch else draft.spread(drafting, batch)

    def _chain(self, logits, drafting, only, budgets, vocab_size, params: SamplingParams, generators) -> Draft:
        """A chain for the drafting rows from their first logits (D, S): a drafting forward per further token."""
        kv, vocabs = self.kv, self.vocabs
        width = max(budgets)
        tokens = torch.zeros(len(drafting), width, dtype=torch.long)
        probs = None if params.greedy else [[] for _ in drafting]
        mask = vocabs.mask(drafting, logits.shape[-1]) if params.greedy else None  # each row's own columns
        active = list(range(len(drafting)))
        forwards = 1
        guides = [self.guides[row] if len(self.guides) > row else None for row in drafting]  # constrained rows' parsers
        pushed = [0] * len(drafting)
        budgets = list(budgets)
        for j in range(width):
            picked = []
            for a, i in enumerate(active):
                row = drafting[i]
                allowed = None  # over the head's columns: what the row's constraint allows next
                if guides[i] is not None:
                    allowed = guides[i].allowed(logits.shape[-1], vocabs.head.ids if vocabs.head is not None else None)
                    if not bool(vocabs.logits(row, allowed).any()):  # nothing of its columns: it stops here
                        budgets[i], allowed = min(budgets[i], j), None
                if params.greedy:
                    own = logits[a] if mask is None else logits[a].masked_fill(~mask[i].to(logits.device), float("-inf"))
                    if allowed is not None:
                        own = own.masked_fill(~allowed.to(own.device), float("-inf"))
                    column = int(own.argmax())  # of the head's (the union's) columns
                    token = column if vocabs.head is None else int(vocabs.head.ids[column])
                else:
                    scores = vocabs.logits(row, logits[a : a + 1])
                    if allowed is not None:
                        scores = scores.masked_fill(~vocabs.logits(row, allowed)[None].to(scores.device), float("-inf"))
                    dist = processed_probs(scores, params)[0].cpu()  # (S_b,)
                    probs[i].append(on_vocabulary(dist, vocabs.token_ids(row), vocab_size))
                    token = token_of(vocabs.token_ids(row), sample(dist, generators[i]))
                tokens[i, j] = token
                picked.append(token)
                if guides[i] is not None and j < budgets[i]:  # the parser follows the chain; an end of sequence ends it
                    if guides[i].push(token):
                        pushed[i] += 1
                    else:
                        budgets[i] = j + 1
            active_next = [i for i in active if budgets[i] > j + 1]
            if not active_next:
                break
            fed = [[token] for i, token in zip(active, picked) if budgets[i] > j + 1]  # active_next's, in order
            logits = kv.forward(fed, 1, only=[only[i] for i in active_next], layers=self.layers,
                                head=self._head)[:, -1]
            forwards += 1
            active = active_next
        for g, n in zip(guides, pushed):
            if g is not None:
                g.pop(n)
        lengths = torch.tensor([min(b, width) for b in budgets], dtype=torch.long)
        draft_probs = None
        if probs is not None:
            draft_probs = torch.zeros(len(drafting), width, vocab_size)
            for i, p in enumerate(probs):
                if p:
                    draft_probs[i, : len(p)] = torch.stack(p)
        return Draft(tokens, lengths, draft_probs, forwards=forwards, forward_rows=len(drafting))

    def accept(self, verified) -> None:
        """A greedy tree's nodes the target tested, counted by rank and draft probability (auto trees grow by them)."""
        for row, nodes in self._nodes.items():
            record_acceptance(self._times, nodes, verified.paths[row])
        self._nodes = {}


class _OnLayers:
    """The target's cache as draft_tree.grow drives a draft model's: each forward runs the drafting
    layers, then the head (the proposer's, restricted or not)."""

    def __init__(self, kv, layers, head):
        self.kv, self.layers, self.head = kv, layers, head

    def forward(self, rows, logits_to_keep, head=None, parents=None, only=None):
        return self.kv.forward(rows, logits_to_keep, parents=parents, only=only, layers=self.layers, head=self.head)
