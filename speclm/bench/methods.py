"""Benchmark methods: `name[:key=value,...]`, e.g. `none`, `draft:k=4`, `draft:k=6,confidence=0.4`, `pld:k=8,ngram_max=2`,
`draft+pld:ngram_min=3`,
`medusa:tree=FILE`, `eagle:heads=FILE`, `hf`, `hf-assisted:k=4`, `hf-pld:k=10`, `none:quantize=none` (that method on other weights
than bench's --quantize, to compare fp32 and int8 side by side in one run), and the peers `llama.cpp`, `llama.cpp-pld`,
`openvino`, `openvino-draft`, `openvino-pld` (speclm.bench.peers).

speclm methods run through `SpecEngine`; `hf*` methods through transformers' `generate` on
the very same model objects (so on the same weights, dtype and threads); peers through their
own engines on the same source weights.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from speclm.bench import peers
from speclm.defaults import MAX_K
from speclm.methods import DRAFT_MODEL, NAMES as METHODS, needing, using
from speclm.engine import SpecEngine
from speclm.errors import UsageError
from speclm.quant.weights import QUANTIZE_MODES
from speclm.stats import RequestStats

HF_METHODS = ("hf", "hf-assisted", "hf-pld")
OPTION_TYPES = {"k": int, "ngram_max": int, "ngram_min": int, "quantize": str, "confidence": float,
                "alternatives": float, "vocab": int, "prompt_ratio": float, "tree": str, "heads": str,
                "acceptance": str, "w": int, "n": int, "g": int, "layers": str, "self_weights": str, "draft_model": str,
                **{key: str for key in peers.OPENVINO_OPTIONS}}


@dataclass(frozen=True)
class MethodSpec:
    label: str  # as written by the user; the key in every report
    name: str  # a speclm method, hf | hf-assisted | hf-pld, or a peer (speclm.bench.peers.PEER_METHODS)
    options: dict = field(default_factory=dict, hash=False)

    @property
    def is_hf(self) -> bool:
        return self.name in HF_METHODS

    @property
    def is_peer(self) -> bool:
        return self.name in peers.PEER_METHODS

    @property
    def plain(self) -> str:
        """The method whose greedy output this one's must equal: its own engine's plain decoding."""
        return peers.PLAIN[self.name] if self.is_peer else "none"

    @property
    def needs_draft(self) -> bool:
        return self.name in needing(DRAFT_MODEL) + ("hf-assisted", "openvino-draft")

    @property
    def uses_draft(self) -> bool:
        """It runs with --draft where one is given (auto: without one too)."""
        return self.needs_draft or self.name in using(DRAFT_MODEL)

    @property
    def quantize(self) -> str | None:
        """The weights this method runs on; None: bench's --quantize."""
        return self.options.get("quantize")

    @property
    def draft_model(self) -> str | None:
        """The draft this method drafts with; None: bench's --draft (to compare drafts in one run)."""
        return self.options.get("draft_model")

    @property
    def decoding_options(self) -> dict:
        names = {"vocab": "draft_vocab", "prompt_ratio": "draft_prompt_ratio"}  # the method option's short name -> GenerationOptions'
        out = {names.get(k, k): v for k, v in self.options.items() if k not in ("quantize", "w", "n", "g", "draft_model")}
        shape = [self.options.get(key) for key in ("w", "n", "g")]
        if any(v is not None for v in shape):  # lookahead's W, N, G: each given, or its default
            from speclm.options import GenerationOptions

            default = GenerationOptions().lookahead_shape
            out["lookahead"] = tuple(v if v is not None else d for v, d in zip(shape, default))
        return out


def parse_methods(text: str) -> list[MethodSpec]:
    specs = []
    for label in _split(text):
        name, _, opts = label.partition(":")
        known = METHODS + HF_METHODS + peers.PEER_METHODS
        if name not in known:
            raise UsageError(f"unknown method '{name}' (choose from {', '.join(known)})")
        options = {}
        for item in filter(None, opts.split(",")):
            key, eq, value = item.partition("=")
            if not eq or key not in OPTION_TYPES:
                raise UsageError(f"bad option '{item}' in method '{label}' (options: {', '.join(OPTION_TYPES)})")
            try:
                options[key] = OPTION_TYPES[key](value)
            except ValueError:
                kind = "a number" if OPTION_TYPES[key] is float else "an integer"
                raise UsageError(f"option {key} of method '{label}' must be {kind}") from None
        if name in peers.PEER_METHODS:
            if "quantize" in options:
                raise UsageError(f"method {label} runs its own engine's weights: it takes weights=, not quantize=")
            peers.check(name, options)
        elif set(options) & set(peers.OPENVINO_OPTIONS):
            raise UsageError(f"weights= and draft_weights= are options of the openvino methods, not of '{label}'")
        if "draft_model" in options and (name in HF_METHODS or name in peers.PEER_METHODS or name not in using(DRAFT_MODEL)
                                         and name not in needing(DRAFT_MODEL)):
            raise UsageError(f"draft_model= is an option of speclm's methods that draft with a model, not of '{label}'")
        if options.get("quantize", "none") not in QUANTIZE_MODES:
            raise UsageError(f"quantize must be one of {', '.join(QUANTIZE_MODES)} in method '{label}'")
        if options.get("k", 1) < 1:
            raise UsageError(f"k must be >= 1 in method '{label}'")
        if options.get("k", 1) > MAX_K:
            raise UsageError(f"k must be <= {MAX_K} (tokens drafted per round) in method '{label}', got {options['k']}")
        specs.append(MethodSpec(label, name, options))
    if not specs:
        raise UsageError("no methods given")
    if len({s.label for s in specs}) != len(specs):
        raise UsageError("a method is listed twice")
    return specs


def _split(text: str) -> list[str]:
    """Split `a,b:k=4,c:k=2,ngram_max=2` at commas that start a new method."""
    parts: list[str] = []
    for piece in text.split(","):
        piece = piece.strip()
        if not piece:
            continue
        if parts and "=" in piece and ":" not in piece:
            parts[-1] += "," + piece  # an option of the previous method
        else:
            parts.append(piece)
    return parts


@dataclass
class RunResult:
    token_ids: list[int]
    seconds: float
    stats: RequestStats | None  # None for hf methods and peers (they report none)


def run_method(spec: MethodSpec, engine: SpecEngine, prompt_ids: list[int], max_new_tokens: int,
               temperature: float, seed: int, peer=None) -> RunResult:
    """One generation; `peer` is the peer engine of a peer method (speclm.bench.peers.make_peer)."""
    if spec.is_peer:
        start = time.perf_counter()
        ids = peer.generate(prompt_ids, max_new_tokens, temperature, seed)
        return RunResult(ids, time.perf_counter() - start, None)
    if spec.is_hf:
        return _run_hf(spec, engine, prompt_ids, max_new_tokens, temperature, seed)
    start = time.perf_counter()
    out = engine.generate(prompt_ids, method=spec.name, max_new_tokens=max_new_tokens,
                          temperature=temperature, seed=seed, **spec.decoding_options)
    return RunResult(out.token_ids, time.perf_counter() - start, out.stats)


@torch.inference_mode()
def _run_hf(spec, engine, prompt_ids, max_new_tokens, temperature, seed) -> RunResult:
    target = engine.target
    ids = torch.tensor([prompt_ids], device=target.model.device)
    kwargs = dict(
        max_new_tokens=max_new_tokens, do_sample=temperature > 0, eos_token_id=list(target.eos_token_ids),
        pad_token_id=target.tokenizer.pad_token_id if target.tokenizer.pad_token_id is not None else target.eos_token_ids[0],
    )
    if temperature > 0:
        kwargs.update(temperature=temperature, top_k=0, top_p=1.0)
        torch.manual_seed(seed)  # transformers samples from torch's global generator
    else:
        kwargs.update(temperature=None, top_k=None, top_p=None)
    if spec.name == "hf-assisted":
        if engine.draft is None:
            raise UsageError("hf-assisted needs --draft")
        kwargs["assistant_model"] = engine.draft.model
        if "k" in spec.options:  # a fixed draft length, like speclm's; else transformers' adaptive default
            kwargs.update(num_assistant_tokens=spec.options["k"], num_assistant_tokens_schedule="constant",
                          assistant_confidence_threshold=0.0)
    elif spec.name == "hf-pld":
        kwargs["prompt_lookup_num_tokens"] = spec.options.get("k", 10)
        if "ngram_max" in spec.options:
            kwargs["max_matching_ngram_size"] = spec.options["ngram_max"]
    start = time.perf_counter()
    out = target.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **kwargs)
    seconds = time.perf_counter() - start
    return RunResult(out[0, len(prompt_ids):].tolist(), seconds, None)
