"""Every decoding method, declared once: what it needs, the shapes it drafts, the options it takes,
its tuned defaults (read from speclm.defaults), a one-line description, and how it builds its
proposer. The engine, options, the command line, the server, adaptive speculation, the bench and
the docs read this table; no other module branches on a method's name (tests/test_methods.py).

Adding a method is one entry here, one proposer in speclm/proposers/, and its tests
(docs/architecture.md, "Adding a method").
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Callable

from speclm import defaults

if TYPE_CHECKING:  # the builders' arguments; no import at run time (the engine imports this module)
    from speclm.engine import SpecEngine
    from speclm.options import GenerationOptions
    from speclm.proposers import Proposer

# what a method needs besides the target
NOTHING, DRAFT_MODEL, HEADS = "", "draft model", "heads"
# GenerationOptions fields that apply to some methods only (the others apply to every method)
LOOKUP_OPTIONS = frozenset({"ngram_max", "ngram_min"})
DRAFT_OPTIONS = frozenset({"confidence", "alternatives", "draft_vocab", "tree"})
HEAD_OPTIONS = frozenset({"heads", "acceptance"})


@dataclass(frozen=True)
class Weights:
    """The weights a default may depend on: the target's and the draft model's (None: no draft)."""

    quantize: str = "none"  # none | int8 | int4
    draft_quantize: str | None = None

    @property
    def quantized(self) -> bool:
        return self.quantize != "none"


@dataclass(frozen=True)
class Method:
    name: str
    about: str  # one line: the CLI's help and docs/methods.md's table
    build: Callable[["SpecEngine", "GenerationOptions"], "Proposer | None"]
    k: Callable[[Weights, "GenerationOptions"], int]  # the default draft length (deepest node) per round
    needs: str = NOTHING  # NOTHING, DRAFT_MODEL or HEADS
    shapes: tuple[str, ...] = ("chain",)  # what it drafts: "chain", "tree"
    options: frozenset[str] = field(default_factory=frozenset)  # the method-specific options it takes
    heads: str | None = None  # the kind of heads it drafts with (speclm.heads), where it needs heads
    ngram_min: int = 1  # prompt lookup's shortest n-gram by default, where it looks up
    tree_default: str | None = None  # --tree's default, where it takes one
    runs_model: bool = False  # a model's forwards draft (a draft model, heads, the target's own layers)
    # auto's children: their order (1 first: the first tried); 0: not a child
    planned: int = 0
    fallback: bool = False  # auto: a child only where no other child runs a model (it costs a setup of its own)
    # auto: the method this child drafts as beside its lookup child (a `+pld` method: its model alone,
    # Proposer.drop_lookup); what `speclm tune` measures of it. None: itself
    drafts_as: str | None = None
    plans: bool = False  # the planner's own method (auto): its proposer plans each row among the planned methods

    def __post_init__(self) -> None:
        assert (self.needs == HEADS) == (self.heads is not None), self.name

    @property
    def proposes(self) -> bool:
        return self.name != "none"


def _none(engine, opts):
    return None


def _draft_model_k(w: Weights, opts=None) -> int:
    return defaults.K_DRAFT_INT4 if w.draft_quantize == "int4" else defaults.K_DRAFT


def _pld_k(w: Weights, opts=None) -> int:
    return defaults.K_PLD_QUANTIZED if w.quantized else defaults.K_PLD


def _pld(engine, opts):
    from speclm.proposers import PromptLookupProposer

    return PromptLookupProposer(k=engine.draft_length(opts), max_ngram=opts.ngram_max,
                                min_ngram=opts.lookup_ngram_min)


def _draft_model_options(engine, opts) -> dict:
    draft = engine.require_draft(opts.method)
    return dict(k=engine.draft_length(opts), confidence=opts.draft_confidence(draft.quantize),
                vocab=opts.draft_vocabulary(), always=tuple(engine.target.eos_token_ids),
                alternatives=opts.draft_alternatives(draft.quantize), tree=engine.draft_tree(opts),
                times=engine.draft_times, prefix_cache=engine.prefix.draft)


def _draft(engine, opts):
    from speclm.proposers import DraftModelProposer

    return DraftModelProposer(engine.draft.model if engine.draft else None, **_draft_model_options(engine, opts))


def _draft_pld(engine, opts):
    from speclm.proposers import DraftLookupProposer

    model = _draft_model_options(engine, opts)
    lookup_k = opts.k if opts.k is not None else _pld_k(engine.weights)
    return DraftLookupProposer(engine.draft.model, **model, ngram_max=opts.ngram_max, ngram_min=opts.lookup_ngram_min,
                               prompt_ratio=opts.draft_prompt_ratio, lookup_k=lookup_k)


def _medusa(engine, opts):
    from speclm.proposers.medusa import MedusaProposer

    heads = engine.heads("medusa", opts.heads)
    tree = opts.tree if opts.tree is not None else opts.spec.tree_default
    # "static": the tuned tree beside the heads where one ships, else a grown one
    static = tree == "static" and (opts.tree is not None or heads.tree_file.is_file())
    choices = heads.static_tree() if static else opts.tree_spec.choices
    whole = choices is not None and not static  # a --tree FILE: verified whole, whatever the costs
    return MedusaProposer(heads.module, heads.vocab_ids, heads.output_head, engine.draft_length(opts),
                          choices=choices, costs=None if whole else engine.forward_costs())


def _eagle_proposer(engine, opts):
    from speclm.proposers.eagle import EagleProposer

    heads = engine.heads("eagle", opts.heads)
    return EagleProposer(heads.module, heads.vocab_ids, heads.output_head, heads.embed, engine.draft_length(opts),
                         costs=engine.forward_costs())


def _eagle_pld(engine, opts):
    from speclm.proposers.lookup_first import LookupFirstProposer

    return LookupFirstProposer(_eagle_proposer(engine, opts), k=_pld_k(engine.weights), ngram_max=opts.ngram_max,
                              ngram_min=opts.lookup_ngram_min)


def _lookahead(engine, opts):
    from speclm.proposers.lookahead import LookaheadProposer

    window, ngram, guesses = opts.lookahead_shape
    return LookaheadProposer(window=window, ngram=ngram, guesses=guesses, pool_size=defaults.LOOKAHEAD_POOL,
                             prompt_ngrams=True)


def _lookahead_pld(engine, opts):
    from speclm.proposers.lookup_first import LookupFirstProposer

    return LookupFirstProposer(_lookahead(engine, opts), k=_pld_k(engine.weights), ngram_max=opts.ngram_max,
                               ngram_min=opts.lookup_ngram_min)


def _self(engine, opts):
    from speclm.proposers.self_draft import SelfDraftProposer

    stack, head = engine.self_stack(opts)
    tree = opts.tree_spec
    if tree is not None and tree.choices is None and opts.sampling.greedy:  # auto, greedy: sized by the
        tree = replace(tree, costs=engine.forward_costs())  # target's measured costs (sampled: its fixed shape)
    vocab = defaults.SELF_VOCAB if opts.draft_vocab is None else opts.draft_vocab
    return SelfDraftProposer(engine.target.model, stack, engine.draft_length(opts), head=head, tree=tree,
                             times=engine.self_times(stack), vocab=vocab, always=tuple(engine.target.eos_token_ids))


def children(engine, opts, fallback: bool | None = None) -> "list[GenerationOptions]":
    """auto's children for this engine: the options of each planned method the loaded models allow
    (a draft model loaded; heads shipped for the target, or --heads), in the registry's order.
    Fallback methods (where no other child runs a model): with fallback True; None: those the
    engine's profile measured (`speclm tune` sets them up; a request never waits for their setup)."""
    from dataclasses import replace as with_

    from speclm.errors import UsageError

    def allowed(m: Method) -> bool:
        if m.needs == DRAFT_MODEL:
            return engine.draft is not None
        if m.needs == HEADS:
            try:
                engine.heads(m.heads, opts.heads)
            except UsageError:
                return False
        return True

    ranked = sorted((m for m in REGISTRY.values() if m.planned and allowed(m)), key=lambda m: m.planned)
    first = [m for m in ranked if not m.fallback]
    if any(m.runs_model for m in first):
        chosen = first
    else:
        chosen = [m for m in ranked if not m.fallback or (m.name in engine.measured_children if fallback is None
                                                         else fallback)]
    return [with_(opts, method=m.name, heads=opts.heads if m.needs == HEADS else None) for m in chosen]


def _auto(engine, opts):
    from speclm.proposers.auto import AutoProposer

    return AutoProposer({o.method: REGISTRY[o.method].build(engine, o) for o in children(engine, opts)})


REGISTRY: dict[str, Method] = {m.name: m for m in (
    Method("none", "plain decoding through the same engine: the baseline", _none, lambda w, o: 0),
    Method("draft", "a draft model with the target's tokenizer proposes", _draft, _draft_model_k,
           needs=DRAFT_MODEL, shapes=("chain", "tree"), options=DRAFT_OPTIONS, tree_default=defaults.TREE,
           runs_model=True),
    Method("pld", "prompt lookup: what followed the last earlier match of the context's trailing n-gram",
           _pld, _pld_k, options=LOOKUP_OPTIONS, planned=3),
    Method("draft+pld", "per row and round: prompt lookup where the context repeats itself, else the draft model",
           _draft_pld, _draft_model_k, needs=DRAFT_MODEL, shapes=("chain", "tree"),
           options=DRAFT_OPTIONS | LOOKUP_OPTIONS | {"draft_prompt_ratio"}, ngram_min=defaults.NGRAM_MIN_DRAFT_PLD,
           tree_default=defaults.TREE, runs_model=True, planned=1, drafts_as="draft"),
    Method("medusa", "trained Medusa heads on the target's last feature propose a tree", _medusa,
           lambda w, o: defaults.K_MEDUSA, needs=HEADS, shapes=("tree",), options=HEAD_OPTIONS | {"tree"},
           heads="medusa", tree_default=defaults.MEDUSA_TREE, runs_model=True),
    Method("eagle", "a trained EAGLE head on the target's features proposes a dynamic tree", _eagle_proposer,
           lambda w, o: defaults.K_EAGLE, needs=HEADS, shapes=("tree",), options=HEAD_OPTIONS, heads="eagle",
           runs_model=True),
    Method("eagle+pld", "per row and round: prompt lookup where the context repeats itself, else eagle's tree",
           _eagle_pld, lambda w, o: defaults.K_EAGLE, needs=HEADS, shapes=("chain", "tree"),
           options=HEAD_OPTIONS | LOOKUP_OPTIONS, heads="eagle", ngram_min=defaults.NGRAM_MIN_DRAFT_PLD,
           runs_model=True, planned=2, drafts_as="eagle"),
    Method("lookahead", "lookahead decoding: Jacobi iteration over a window fills an n-gram pool; "
           "its n-grams that follow the context are verified", _lookahead,
           lambda w, o: max(o.lookahead_shape[0], o.lookahead_shape[1] - 1), shapes=("tree",),
           options=frozenset({"lookahead"})),
    Method("lookahead+pld", "per row and round: prompt lookup where the context repeats itself, else lookahead",
           _lookahead_pld, lambda w, o: max(_pld_k(w), o.lookahead_shape[0], o.lookahead_shape[1] - 1),
           shapes=("chain", "tree"), options=LOOKUP_OPTIONS | {"lookahead"}, ngram_min=defaults.NGRAM_MIN_DRAFT_PLD),
    Method("self", "self-speculation: the target's own layers, some skipped, draft a chain or a tree", _self,
           lambda w, o: defaults.K_SELF, shapes=("chain", "tree"), options=frozenset({"layers", "self_weights", "tree", "draft_vocab"}),
           runs_model=True, planned=4, fallback=True),
    Method("auto", "per request and round, the planner picks among the methods the loaded models allow "
           "(draft+pld, eagle+pld, pld; self where no model drafts), the draft length, or none",
           _auto, lambda w, o: 0, shapes=("chain", "tree"), options=frozenset({"heads"}), runs_model=True, plans=True),
)}
NAMES: tuple[str, ...] = tuple(REGISTRY)


def method(name: str) -> Method:
    """The method called `name`; KeyError where there is none (GenerationOptions says it as a usage error)."""
    return REGISTRY[name]


def needing(need: str) -> tuple[str, ...]:
    """The methods that need `need` (DRAFT_MODEL, HEADS)."""
    return tuple(m.name for m in REGISTRY.values() if m.needs == need)


def using(need: str) -> tuple[str, ...]:
    """The methods that run with `need` (DRAFT_MODEL, HEADS) where it is loaded: those that need it,
    and auto where a planned method needs it (auto runs without it too)."""
    planned = any(m.needs == need and m.planned for m in REGISTRY.values())
    return tuple(m.name for m in REGISTRY.values() if m.needs == need or (m.plans and planned))


def taking(option: str) -> tuple[str, ...]:
    """The methods that take a method-specific option (a GenerationOptions field)."""
    return tuple(m.name for m in REGISTRY.values() if option in m.options)


def help_text() -> str:
    """--method's help: each method and what it does."""
    return "; ".join(f"{m.name}: {m.about}" for m in REGISTRY.values())


def markdown_table() -> str:
    """The methods as docs/methods.md shows them (tests/test_docs.py checks the page holds it)."""
    rows = ["| method | what proposes | needs | drafts | deepest draft (int8 target, int4 draft) |", "|---|---|---|---|---|"]
    for m in REGISTRY.values():
        from speclm.options import GenerationOptions as Options  # options reads this module: imported here

        k = "–" if not m.proposes else "planned" if m.plans else str(m.k(Weights("int8", "int4"), Options(method=m.name)))
        rows.append(f"| `{m.name}` | {m.about} | {m.needs or 'nothing'} | {', '.join(m.shapes) if m.proposes else '–'} "
                    f"| {k} |")
    return "\n".join(rows)
