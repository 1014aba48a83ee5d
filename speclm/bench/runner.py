"""The benchmark protocol.

1. Load the target (and draft) once; every method, speclm's and transformers', uses those
   model objects.
2. Measure the cost model (v(k), c) on the first prompt.
3. Warm up every method on a short generation.
   Each speclm method keeps its own prefix cache (speclm.forward.prefix_cache), emptied after the
   warm-up: it sees the prompts before the current one, as a server would, and never a prompt
   another method just read (which would spare it that prompt's prefill).
4. For each prompt, for each repeat, run every method in turn (A B C A B C ...), so that
   drift of a shared machine hits all methods alike.
5. Greedy outputs of every method are compared with `none` token for token (a peer's with its
   own engine's plain decoding, speclm.bench.peers.PLAIN); a mismatch is reported with its
   first differing position and the target's top-2 logit margin there, which tells a
   floating-point near-tie from a bug. Sampled outputs of speclm's methods are compared too:
   a seeded request's text is its plain decoding's with that seed (speclm.sampling.Coupled).
6. Each run records the process's peak resident memory during it (its peak is reset before the
   run: speclm.memory). Every method's models and heads were loaded by the warm-up, so a peak is
   a run's growth over all of them, not what the method needs alone.
7. Results are written after every prompt; an interrupted run (Ctrl-C, SIGTERM) keeps
   what it finished and says so.
"""

from __future__ import annotations

import datetime as dt
import json
import shlex
import signal
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from speclm import memory
from speclm.bench import report
from speclm.bench.costs import measure_costs
from speclm.bench.dataset import BenchPrompt
from speclm.bench.machine import machine_facts
from speclm.bench.methods import MethodSpec, run_method
from speclm.bench.peers import describe as describe_peer, make_peer
from speclm.engine import GenerationOptions, SpecEngine
from speclm.defaults import COST_REPEATS
from speclm.methods import DRAFT_MODEL, REGISTRY
from speclm.forward.prefix_cache import DEFAULT_TOKENS, PrefixCaches

SCHEMA_VERSION = 1


@dataclass
class BenchConfig:
    target: str
    draft: str | None
    methods: list[str]
    dataset: str
    categories: list[str] | None
    per_category: int | None
    max_new_tokens: int
    temperature: float
    seed: int
    repeats: int
    chat: bool
    dtype: str = "float32"
    cost_repeats: int = COST_REPEATS
    quantize: str = "none"  # the weights of methods without their own quantize= option
    draft_quantize: str | None = None  # the draft's weights in every method, if not the method's
    prefix_cache: int = DEFAULT_TOKENS  # tokens of recent prompts each model keeps, per method (0: none)


def run_bench(engine: SpecEngine, specs: list[MethodSpec], prompts: list[BenchPrompt], config: BenchConfig,
              out_dir: Path, progress: bool = True, measure_cost_model: bool = True,
              engines: dict[str, SpecEngine] | None = None) -> dict:
    """`engine` runs on config.quantize weights with config.draft; `engines` maps the other
    (quantize mode, draft model) pairs that methods ask for (`none:quantize=none`,
    `draft:draft_model=DIR`; a None draft: config.draft) to engines over those weights."""
    engines = {**(engines or {}), (config.quantize, None): engine}

    def key_of(spec: MethodSpec) -> tuple[str, str | None]:
        return spec.quantize or config.quantize, spec.draft_model

    missing = {key_of(s) for s in specs} - set(engines)
    if missing:
        raise ValueError(f"no engine for {', '.join(f'quantize={q} draft_model={d}' for q, d in sorted(missing, key=str))}")

    def engine_of(spec: MethodSpec) -> SpecEngine:
        return engines[key_of(spec)]

    caches: dict[str, PrefixCaches] = {}  # method label -> its own prefix caches
    encoded = engine.encode([p.text for p in prompts], config.chat)
    peer_engines = {}  # peer method label -> its engine (each keeps its own cache of the last prompt)
    for spec in specs:
        if spec.is_peer:
            peer_engines[spec.label] = make_peer(
                spec.name, spec.options, config.target, config.draft, max(map(len, encoded)) + config.max_new_tokens + 64,
                torch.get_num_threads(), tuple(engine.target.eos_token_ids), progress)

    def run(spec: MethodSpec, ids: list[int], max_new_tokens: int, seed: int):
        engine = engine_of(spec)
        engine.prefix = caches.setdefault(spec.label, PrefixCaches.of_size(config.prefix_cache))
        return run_method(spec, engine, ids, max_new_tokens, config.temperature, seed, peer_engines.get(spec.label))

    out_dir.mkdir(parents=True, exist_ok=True)
    results = {
        "schema": SCHEMA_VERSION,
        "command": "speclm " + " ".join(shlex.quote(a) for a in sys.argv[1:]) if sys.argv[0].endswith("speclm") else None,
        "created": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "complete": False,
        "machine": machine_facts(),
        "resident_after_load": asdict(now) if (now := memory.resident()) else None,
        "config": asdict(config),
        "peers": {s.label: describe_peer(s.name, s.options, peer_engines[s.label]) for s in specs if s.is_peer},
        "cost_model": None,
        "runs": [],
    }
    stop = _install_sigterm()
    total = len(prompts) * config.repeats * len(specs)
    bar = tqdm(total=total, desc="bench", unit="run", disable=not progress)
    try:
        if measure_cost_model:
            bar.set_postfix_str("cost model")
            results["cost_model"] = measure_costs(
                engine.target.model, engine.draft.model if engine.draft else None, encoded[0][:256],
                repeats=config.cost_repeats,
                pld_labels=[s.label for s in specs if s.name in REGISTRY and REGISTRY[s.name].proposes and not REGISTRY[s.name].runs_model],
                draft_vocabs={s.label: GenerationOptions(method=s.name, **s.decoding_options).draft_vocabulary()
                              for s in specs if s.name in REGISTRY and REGISTRY[s.name].needs == DRAFT_MODEL},
                always=tuple(engine.target.eos_token_ids),
            )
        bar.set_postfix_str("warm-up")
        for spec in specs:
            run(spec, encoded[0], 8, config.seed)
        caches.clear()  # the first prompt is read whole, as a server's first request
        # plain decoding runs first on each set of weights and each peer engine: the others' reference;
        # the others in an order turned by one each prompt, so each follows every other as often (what
        # a method leaves in memory and caches, such as self's int4 copy of the target's layers, then
        # weighs on every method alike, not always on the one after it)
        plain = [s for s in specs if s.name == s.plain]
        rest = [s for s in specs if s.name != s.plain]
        for n, (prompt, ids) in enumerate(zip(prompts, encoded)):
            turn = n % len(rest) if rest else 0
            order = plain + rest[turn:] + rest[:turn]
            for repeat in range(config.repeats):
                reference: dict[str, list[int]] = {}  # quantize mode or peer engine -> its plain decoding's output
                for spec in order:
                    bar.set_postfix_str(f"{prompt.category}/{prompt.prompt_id} {spec.label}")
                    mode = spec.plain if spec.is_peer else spec.quantize or config.quantize
                    memory.reset_peak()
                    r = run(spec, ids, config.max_new_tokens, config.seed + repeat)
                    peak = memory.peak_bytes()
                    if spec.name == spec.plain:
                        reference[mode] = r.token_ids
                    results["runs"].append({**_record(engine_of(spec), prompt, spec, repeat, r, ids, reference.get(mode), config),
                                            "peak_resident_bytes": peak})
                    bar.update(1)
            report.write_all(results, out_dir)
        results["complete"] = True
    except KeyboardInterrupt:
        print(f"\ninterrupted: writing the {len(results['runs'])} finished runs", file=sys.stderr)
    finally:
        bar.close()
        signal.signal(signal.SIGTERM, stop)
        report.write_all(results, out_dir)
    return results


def _record(engine, prompt, spec, repeat, r, prompt_ids, reference, config) -> dict:
    lossless = mismatch = None
    # sampled: speclm's seeded requests only (a peer's or transformers' draws are their own)
    compared = config.temperature == 0 or not (spec.is_peer or spec.is_hf)
    if compared and reference is not None and spec.name != spec.plain:
        lossless = r.token_ids == reference
        if not lossless and (spec.is_peer or config.temperature > 0):  # no greedy margin to show
            mismatch = {**first_difference(reference, r.token_ids), "top2_margin": None}
        elif not lossless:
            mismatch = first_mismatch(engine, prompt_ids, reference, r.token_ids)
    return {
        "prompt_id": prompt.prompt_id,
        "category": prompt.category,
        "method": spec.label,
        "repeat": repeat,
        "prompt_tokens": len(prompt_ids),
        "new_tokens": len(r.token_ids),
        "seconds": r.seconds,
        "tokens_per_second": len(r.token_ids) / r.seconds if r.seconds else 0.0,
        "token_ids": r.token_ids,
        "stats": r.stats.to_dict() if r.stats else None,
        "lossless": lossless,
        "compared_with": spec.plain,
        "mismatch": mismatch,
    }


@torch.inference_mode()
def first_mismatch(engine: SpecEngine, prompt_ids: list[int], reference: list[int], got: list[int]) -> dict:
    """Where two greedy outputs first differ, and the target's top-2 logit margin there."""
    diff = first_difference(reference, got)
    ids = torch.tensor([prompt_ids + reference[:diff["position"]]], device=engine.target.model.device)
    logits = engine.target.model(input_ids=ids, logits_to_keep=1).logits[0, -1].float()
    top = torch.topk(logits, 2)
    return {**diff, "top2_margin": float(top.values[0] - top.values[1])}


def first_difference(reference: list[int], got: list[int]) -> dict:
    """The first position where two outputs differ (or the shorter one's end), and their tokens there."""
    pos = next((i for i, (a, b) in enumerate(zip(reference, got)) if a != b), min(len(reference), len(got)))
    return {"position": pos, "expected": reference[pos] if pos < len(reference) else None,
            "got": got[pos] if pos < len(got) else None}


def _install_sigterm():
    def handler(signum, frame):
        raise KeyboardInterrupt

    return signal.signal(signal.SIGTERM, handler)


def load_results(path: str | Path) -> dict:
    return json.loads(Path(path).read_text(encoding="utf-8"))
