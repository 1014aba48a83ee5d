"""The speculative decoding engine's facade: `generate`, `stream`, and `batch` for requests that
join and leave a running decode (speclm.round.batch holds the round and its contract).

A request's seed: `generate(prompts, seed=s)` gives prompt i the seed s + i; it draws each token by
position (speclm.sampling.Coupled), so its output with a seed is its plain decoding's with that
seed, alone, in any batch, whatever the method. Without one, a random seed seeds its own
generator, and the verifier samples by rejection.
"""

from __future__ import annotations

import secrets
import sys
import time
from collections import deque
from dataclasses import dataclass, replace
from typing import Iterator

from speclm import defaults
from speclm.round.adaptive import Adaptive
from speclm.round.batch import Batch
from speclm.forward.cache import check_fits
from speclm.forward.costs import ForwardCosts, verification_costs
from speclm.errors import UsageError
from speclm.heads.loaded import LoadedHeads
from speclm.methods import DRAFT_MODEL, HEADS, Weights
from speclm.models.loading import LoadedModel
from speclm.constraint import Matcher, tokenizer_for
from speclm.options import GenerationOptions
from speclm.forward.prefix_cache import PrefixCaches
from speclm.proposers import Proposer
from speclm.proposers.draft_tree import DraftTimes, TreeSpec
from speclm.requests import Request, TokenLogprob
from speclm.runtime import bound_freed_memory
from speclm.stats import RequestStats
from speclm.text import IncrementalText, chat_ids, final_text

__all__ = ["SpecEngine", "GenerationOptions", "Completion", "TextStream", "Batch", "Request"]


@dataclass
class Completion:
    prompt_index: int
    text: str
    token_ids: list[int]  # generated ids only
    finish_reason: str  # "stop" (EOS or stop string), "length", or "cancelled" (Batch.cancel)
    stats: RequestStats
    # per generated token, where the request asked (logprobs=N): its log-probability and the N likeliest
    logprobs: list[TokenLogprob] | None = None

    def to_dict(self) -> dict:
        out = {
            "prompt_index": self.prompt_index,
            "text": self.text,
            "token_ids": self.token_ids,
            "finish_reason": self.finish_reason,
            "stats": self.stats.to_dict(),
        }
        if self.logprobs is not None:
            out["logprobs"] = [{"token": e.token, "logprob": e.logprob, "top": [list(p) for p in e.top]}
                               for e in self.logprobs]
        return out


class SpecEngine:
    """Speculative decoding over a loaded target (and optionally a draft) model.

    >>> engine = SpecEngine(load_model("qwen2.5-coder-1.5b"), draft=load_model("qwen2.5-coder-0.5b"))
    >>> engine.generate("def fib(n):", method="draft", max_new_tokens=64).text
    """

    def __init__(self, target: LoadedModel, draft: LoadedModel | None = None, prefix_cache: int = defaults.PREFIX_CACHE_TOKENS):
        """prefix_cache: tokens of recent prompts whose keys and values each model keeps for later
        prompts that begin alike (speclm.forward.prefix_cache; 0: none). Only on quantized CPU weights,
        where reusing them gives the same bits as reading the prompt whole."""
        if prefix_cache < 0:
            raise UsageError(f"prefix-cache must be >= 0 tokens, got {prefix_cache}")
        self.target, self.draft = target, draft
        self.prefix = PrefixCaches.of_size(prefix_cache)
        self.draft_times = DraftTimes()  # the draft's measured forward times, kept across requests (auto trees)
        self._self_layers: dict[tuple[str, str], tuple[int, ...]] = {}  # self's (--layers, weights) -> the layers that draft
        self._self_copy: tuple | None = None  # self's int4 copy, one at a time: (its layers, Stack, head)
        # self's drafting forwards' times and acceptance (auto trees), kept across requests, by (layers, copied)
        self._self_times: dict[tuple[tuple[int, ...], bool], DraftTimes] = {}
        self._heads: dict[tuple[str, str], LoadedHeads] = {}  # (kind, file) -> heads loaded for this target
        # "target"/"draft model" -> forward costs, kept for the engine's life (a table measured on a busy
        # machine is not stored on disk: without this each new proposer would measure it again)
        self._costs: dict[str, ForwardCosts] = {}
        self._planner: Adaptive | None = None
        self._profiles: dict = {}  # speclm.tune key -> Profile
        self.measured_children: dict = {}  # auto's child -> speclm.tune.ChildProfile: every planner's prior
        self._constraint_tokenizer = None  # llguidance's view of the target's tokenizer, made at the first constraint
        if draft is not None:
            check_same_vocabulary(target, draft)

    # ---------------------------------------------------------------- public API
    def generate(self, prompts, batch_size: int | None = None, n: int = 1,
                 **options) -> Completion | list[Completion]:
        """Generate for one prompt (returns a Completion) or a list (returns a list, in order).

        A prompt is a string or a list of token ids. Up to `batch_size` prompts decode together
        (default: all at once), each accepting its own number of tokens per round; as one
        finishes, the next joins. Keyword options are those of `GenerationOptions`.

        n: completions per prompt (a list of n for one prompt, prompt by prompt for a list): choice i
        of prompt p samples with seed + p * n + i (n = 1: prompt p with seed + p), each the same as
        its own run with that seed; the first of a prompt's choices reads the prompt and the others
        join once it has, starting from its keys and values (the prefix cache, on quantized weights).
        """
        single = isinstance(prompts, str) or (prompts and isinstance(prompts[0], int))
        results = list(self.completions([prompts] if single else list(prompts), batch_size, n=n, **options))
        return results[0] if single and n == 1 else results

    def completions(self, prompts: list, batch_size: int | None = None, n: int = 1, **options) -> Iterator[Completion]:
        """`generate` for a list of prompts, each Completion yielded, in order, as soon as it and
        those before it are done. Every prompt is encoded (and checked) before any decoding."""
        opts = GenerationOptions(**options)
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise UsageError(f"n must be an integer >= 1, got {n!r}")
        encoded = self.encode(list(prompts), opts.chat)
        size = batch_size or len(encoded) * n
        if size < 1:
            raise UsageError(f"batch-size must be >= 1, got {size}")
        seed = opts.seed if opts.seed is not None else secrets.randbits(62)
        requests = [Request.of(p, ids, opts, seed + p * n + i, self.target.max_context, seeded=opts.seed is not None,
                               vocab=self.target.vocab_size, matcher=self.matcher(opts))
                    for p, ids in enumerate(encoded) for i in range(n)]
        check_fits(self.target.model, min(size, len(requests)), max(r.prompt_len + r.max_new for r in requests))
        self.prepare(opts)
        waiting = deque(requests)
        leaders = {id(r): requests[k - k % n] for k, r in enumerate(requests)}  # each prompt's first choice
        batch = self.batch(rows=min(size, len(requests)), capacity=max(r.prompt_len + r.max_new for r in requests))
        given = 0
        while waiting or batch.active:
            while waiting and batch.size < size and (n == 1 or _read(waiting[0], leaders)):
                batch.join(waiting.popleft())
            batch.step()
            while given < len(requests) and requests[given].done:
                yield self.completion(requests[given])
                given += 1
                bound_freed_memory()  # after each request: what it freed goes back past a bound

    def stream(self, prompt, **options) -> "TextStream":
        """Iterate over text deltas as tokens are committed; `.completion` holds the result after."""
        return TextStream(self, self.request(prompt, GenerationOptions(**options)))

    def batch(self, rows: int = 1, capacity: int = 0, prefill_chunk: int | None = None,
              speculation: Adaptive | None = None) -> Batch:
        """A running decode that requests join between steps (`Batch.join`, `Batch.step`); rows:
        the most requests expected at once, capacity: tokens a request may hold (both only sizes
        to allocate; more grows the caches); prefill_chunk: prompt tokens read per step at most,
        steps alternating with rounds (None: a prompt at once); speculation: a policy that caps
        each round's draft length (`adaptive()`; None: the methods' k)."""
        return Batch(self, rows, capacity, prefill_chunk, speculation)

    def adaptive(self, plans_only: bool = False) -> Adaptive:
        """Speculation that adapts each round's draft length to the batch (speclm.round.adaptive), from
        this machine's measured forward costs (the target's, and the draft model's where there is one)
        and what `speclm tune` measured of auto's children; plans_only: it plans auto requests alone."""
        return Adaptive(self.forward_costs(), draft_costs=self.draft_costs() if self.draft is not None else None,
                        plans_only=plans_only, measured=self.measured_children)

    def profile(self, opts: GenerationOptions):
        """auto's profile for this engine (speclm.tune): read from the cache, else measured now
        (said once on stderr, with how long it takes) and stored; its children's measurements feed
        every planner of this engine."""
        from speclm import tune

        key = tune.key_of(self, opts)
        if key not in self._profiles:
            profile = tune.load(self, opts)
            if profile is None:
                self.forward_costs()
                print(f"speclm: no tuned profile for {key} on this machine: measuring it now (about "
                      f"{tune.estimate_seconds(self, opts):.0f} s; `speclm tune` does it ahead of time)",
                      file=sys.stderr, flush=True)
                profile = tune.measure(self, opts, progress=sys.stderr.isatty(), fallback=False)
            self._profiles[key] = profile
            self.measured_children.update(profile.children)
        return self._profiles[key]

    def planner(self) -> Adaptive:
        """The policy that plans `auto` requests in `generate`, `stream` and a Batch made without
        one (one per engine: what it measures of the proposers is kept across calls); it leaves
        every other method's k alone."""
        if self._planner is None:
            self._planner = self.adaptive(plans_only=True)
        return self._planner

    def forward_costs(self) -> ForwardCosts:
        """The target's forward time by tokens read (speclm.forward.costs; measured once per model, then cached)."""
        if "target" not in self._costs:
            self._costs["target"] = verification_costs(self.target.model, f"{self.target.name}-{self.target.quantize}")
        return self._costs["target"]

    def draft_costs(self) -> ForwardCosts:
        """The draft model's forward time by tokens read, as forward_costs."""
        if "draft model" not in self._costs:
            self._costs["draft model"] = verification_costs(self.draft.model, f"{self.draft.name}-{self.draft.quantize}")
        return self._costs["draft model"]

    def request(self, prompt, options: GenerationOptions | None = None, index: int = 0, seed: int | None = None,
                **kwargs) -> Request:
        """A request to join a Batch: a prompt (string or token ids) and its own options (a
        GenerationOptions, or its keyword arguments); seed: its generator's (default: options.seed,
        else random)."""
        opts = options if options is not None else GenerationOptions(**kwargs)
        ids = self.encode([prompt], opts.chat)[0]
        seeded = seed is not None or opts.seed is not None
        seed = seed if seed is not None else opts.seed if opts.seed is not None else secrets.randbits(62)
        request = Request.of(index, ids, opts, seed, self.target.max_context, seeded, self.target.vocab_size,
                             matcher=self.matcher(opts))
        check_fits(self.target.model, 1, request.prompt_len + request.max_new)
        self.prepare(opts)
        return request

    def matcher(self, opts: GenerationOptions) -> Matcher | None:
        """A new parser of the request's constraint over the target's tokens (None: unconstrained)."""
        if opts.constraint is None:
            return None
        if self._constraint_tokenizer is None:  # once per engine: about a second for a large vocabulary
            self._constraint_tokenizer = tokenizer_for(self.target.tokenizer, self.target.vocab_size,
                                                       self.target.eos_token_ids)
        return Matcher(opts.constraint, self._constraint_tokenizer, self.target.eos_token_ids)

    def prepare(self, opts: GenerationOptions) -> None:
        """Ready what requests with these options need once per engine, before any of them runs (so
        none pays for it in its time or stats): the heads, loaded; the measured forward costs that
        size trees (the first measurement on a machine takes up to a minute). UsageError where a
        model the method needs is missing."""
        m = opts.spec
        if m.plans:  # auto: what it plans by (the profile: speclm.tune), and what each child needs
            from speclm.methods import children

            self.profile(opts)
            for child in children(self, opts):
                self.prepare(child)
            return
        if m.needs == DRAFT_MODEL:
            self.require_draft(opts.method)
            self.draft_tree(opts)
        if m.needs == HEADS:
            self.heads(m.heads, opts.heads)
            self.forward_costs()
        if "layers" in m.options:
            self.self_stack(opts)

    @property
    def weights(self) -> Weights:
        return Weights(self.target.quantize, self.draft.quantize if self.draft is not None else None)

    def draft_length(self, opts: GenerationOptions) -> int:
        """The request's k, or its method's default for this engine's weights."""
        weights = self.weights
        return opts.draft_length(weights.quantize, weights.draft_quantize)

    def require_draft(self, method: str) -> LoadedModel:
        if self.draft is None:
            raise UsageError(f"method '{method}' needs a draft model (--draft MODEL)")
        return self.draft

    def self_layers(self, opts: GenerationOptions) -> tuple[int, ...]:
        """The target's layers that draft for `self` (--layers; "auto": calibrated on this machine
        once, then cached with the model: speclm.proposers.self_draft.calibrate)."""
        from speclm.proposers.self_draft import parse_layers, resolve_layers

        key = (opts.layers or "auto", self.self_weights(opts))
        if key not in self._self_layers:
            self._self_layers[key] = resolve_layers(parse_layers(key[0]), self, key[1])
        return self._self_layers[key]

    def self_weights(self, opts: GenerationOptions) -> str:
        """self's drafting weights: the request's, else the default (an int4 copy) where int4 layers
        run (speclm's compiled kernels, a target not int4 already), else the target's own."""
        if opts.self_weights is not None:
            return opts.self_weights
        from speclm.quant import kernels

        usable = kernels.enabled() and self.target.quantize != "int4"
        return opts.self_draft_weights if usable else "target"

    def self_stack(self, opts: GenerationOptions):
        """What `self` drafts with: a speclm.forward.lean.Stack of its layers, on the target's own
        weights or (--self-weights int4) their int4 copies, with the head's copy (int4_stack), made
        once per engine and one at a time (a calibration tries several layer sets); its size goes
        to stderr. Returns (Stack, the head's copy, a linear layer, or None)."""
        from speclm.forward.lean import Stack, int4_stack

        layers = self.self_layers(opts)
        if self.self_weights(opts) == "target":
            if len(layers) == len(self.target.model.model.layers):
                raise UsageError("--layers all drafts with every layer: only on an int4 copy (--self-weights int4), "
                                 "which needs speclm's compiled kernels and a target not int4 already")
            return Stack(layers), None
        if self._self_copy is None or self._self_copy[0] != layers:
            from tqdm.auto import tqdm

            if self.target.quantize == "int4":
                raise UsageError("--self-weights int4: the target's weights are int4 already (use target)")
            self._self_copy = None  # the copy before is freed first
            t0 = time.perf_counter()
            with tqdm(total=len(layers) + 1, desc="self: int4 copy", unit="layer", file=sys.stderr, leave=False) as bar:
                stack, head, size = int4_stack(self.target.model, layers, bar.update)
            print(f"speclm: self drafts on an int4 copy of {len(layers)} layers and the head: "
                  f"{size / 2**20:.0f} MiB, made in {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
            self._self_copy = (layers, stack, head)
        return self._self_copy[1], self._self_copy[2]

    def self_times(self, stack) -> DraftTimes:
        """What self's drafting forwards over this Stack took and what the target accepted of them,
        kept across requests (greedy auto trees grow by them, as a draft model's do by draft_times)."""
        return self._self_times.setdefault((stack.indices, bool(stack.copies)), DraftTimes())

    def heads(self, kind: str, path: str | None = None) -> "LoadedHeads":
        """The trained heads of `kind` for this target: from `path`, or those shipped for it
        (speclm.heads.store); loaded once. UsageError where there are none or they do not fit."""
        from speclm.heads import store

        if path is None:
            shipped = store.shipped(self.target.name, kind)
            if shipped is None:
                raise UsageError(f"{kind} heads are needed: none ship for '{self.target.name}'; "
                                 f"train them (speclm heads data, speclm heads train) and pass --heads FILE")
            path = str(shipped)
        key = (kind, str(path))
        if key not in self._heads:
            self._heads[key] = LoadedHeads.load(path, kind, self.target)
        return self._heads[key]

    def completion(self, request: Request) -> Completion:
        text = final_text(self.target.tokenizer, request.generated, request.options.stop)
        return Completion(request.index, text, list(request.generated), request.finish_reason or "length",
                          request.stats, list(request.logprobs) if request.options.logprobs is not None else None)

    def encode(self, prompts: list, chat: bool) -> list[list[int]]:
        tok = self.target.tokenizer
        out = []
        for p in prompts:
            if not isinstance(p, str):
                ids = [int(t) for t in p]
            elif chat:
                if not getattr(tok, "chat_template", None):
                    raise UsageError(f"model '{self.target.name}' has no chat template; drop --chat")
                ids = chat_ids(tok, p)
            else:
                ids = tok(p).input_ids
            if not ids:
                raise UsageError("empty prompt")
            limit = self.target.max_context
            if limit and len(ids) >= limit:
                raise UsageError(f"prompt of {len(ids)} tokens does not fit the context of {limit} tokens")
            out.append(ids)
        return out

    def make_proposer(self, opts: GenerationOptions) -> Proposer | None:
        """The proposer of the request's method (speclm.methods), None for plain decoding."""
        return opts.spec.build(self, opts)

    def draft_tree(self, opts: GenerationOptions) -> TreeSpec | None:
        """A draft model's tree, its auto budget priced by this machine's measured costs (None: a chain)."""
        spec = opts.tree_spec
        if spec is not None and spec.choices is None:  # auto's budget: measured costs (sampling: the draft's too)
            spec = replace(spec, costs=self.forward_costs())
            if not opts.sampling.greedy:
                spec = replace(spec, draft_costs=self.draft_costs())
        return spec


class TextStream:
    """Iterator of text deltas for one prompt; `completion` is set once it is exhausted."""

    def __init__(self, engine: SpecEngine, request: Request):
        self._engine, self._request = engine, request
        self.completion: Completion | None = None

    def __iter__(self) -> Iterator[str]:
        r = self._request
        text = IncrementalText(self._engine.target.tokenizer, r.options.stop)
        batch = self._engine.batch(capacity=r.prompt_len + r.max_new)
        batch.join(r)
        while batch.active:
            batch.step()
            delta = text.delta(r.generated, finished=r.done)
            if delta:
                yield delta
        self.completion = self._engine.completion(r)
        bound_freed_memory()


def _read(request: Request, leaders: dict) -> bool:
    """Whether a request may join: the first of its prompt's n choices always, the others once
    that one has read the prompt (they then start from its keys and values)."""
    first = leaders[id(request)]
    return first is request or first.done or len(first.generated) > 0


def check_same_vocabulary(target: LoadedModel, draft: LoadedModel) -> None:
    """Draft tokens are target token ids, so both must share one tokenizer vocabulary."""
    if target.vocab_size != draft.vocab_size or target.tokenizer.get_vocab() != draft.tokenizer.get_vocab():
        raise UsageError(
            f"draft '{draft.name}' does not share the target's vocabulary "
            f"({draft.vocab_size} vs {target.vocab_size} output ids); pick a draft of the same family"
        )
