"""`generate`-style options of one request, validated where they are made; the method's tuned
defaults (speclm.defaults) are resolved here, in one place."""

from __future__ import annotations

from dataclasses import InitVar, dataclass, replace

from speclm import defaults
from speclm.constraint import Constraint
from speclm.errors import UsageError
from speclm.methods import NAMES, REGISTRY, Method, Weights, taking
from speclm.proposers.draft_tree import TreeSpec, parse_tree
from speclm.sampling import SamplingParams

MAX_LOGPROBS = 20  # OpenAI's top_logprobs bound


@dataclass(frozen=True)
class GenerationOptions:
    """`generate`-style arguments."""

    method: str = "auto"  # a name of speclm.methods.REGISTRY; auto: the planner picks per request and round
    k: int | None = None  # draft length per round; None: the method's default
    max_new_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    chat: bool = False  # apply the target's chat template to each prompt as one user message
    ignore_eos: bool = False  # go on past EOS to max_new_tokens (benchmarks of fixed lengths)
    ngram_max: int = defaults.NGRAM_MAX  # pld, draft+pld, eagle+pld: longest n-gram to match
    ngram_min: int | None = None  # pld, draft+pld, eagle+pld: shortest n-gram to match (None: the method's default)
    # draft: stop a round after a token the draft gave less probability than this (0: never;
    # None: speclm.defaults.CONFIDENCE_INT4 with an int4 draft, else 0)
    confidence: float | None = None
    # draft: a drafted token the draft gave less probability than this gets a second candidate
    # verified beside it (0: never; None: speclm.defaults.ALTERNATIVES_INT4 with an int4 draft, else 0)
    alternatives: float | None = None
    # draft: score only the this many lowest token ids, the prompt's tokens and EOS
    # (speclm.proposers.draft_vocab; 0: the whole vocabulary; None: speclm.defaults.DRAFT_VOCAB)
    draft_vocab: int | None = None
    # draft+pld: no draft model for a request whose prompt is longer than this times its
    # max_new_tokens (prompt lookup alone); 0: never the model, inf: always
    draft_prompt_ratio: float = defaults.DRAFT_PROMPT_RATIO
    # draft, draft+pld: the draft's shape each round: "chain", "auto" (a tree grown from the draft's
    # probabilities, its size chosen from this machine's measured verification cost) or a JSON
    # file of root paths of ranks (speclm.proposers.draft_tree); None: speclm.defaults.TREE
    tree: str | None = None
    # medusa, eagle, eagle+pld: a heads file (speclm.heads.store); None: the heads shipped for the target
    heads: str | None = None
    # "exact" (lossless rejection sampling) or "typical": Medusa's typical acceptance, LOSSY at
    # temperature > 0 (speclm.round.verify.typical_paths); head methods only
    acceptance: str = "exact"
    # lookahead: (window W, n-gram size N, n-grams verified G); None: speclm.defaults.LOOKAHEAD_*
    lookahead: tuple[int, int, int] | None = None
    # self: the target's layers that draft: "auto" (calibrated on this machine, speclm.proposers.self_draft),
    # "N" (the first N: early exit) or "skip:I,J-K" (every layer but these); None: "auto"
    layers: str | None = None
    # self: the weights its layers draft with: "target" (the target's own) or "int4" (an int4 copy of the
    # drafting layers and the head, made once at first use); None: speclm.defaults.SELF_WEIGHTS
    self_weights: str | None = None
    # the output follows this JSON schema, regex or grammar (speclm.constraint); None: free text.
    # Given as a Constraint, or as OpenAI's response_format / speclm's regex / grammar (at most one)
    constraint: Constraint | None = None
    # return each generated token's log-probability and this many most likely alternatives (0-20;
    # None: none): the target's distribution at temperature 1 where the token was committed
    # (a constraint's forbidden tokens removed), from the forward that verified it
    logprobs: int | None = None
    response_format: InitVar[dict | None] = None
    regex: InitVar[str | None] = None
    grammar: InitVar[str | None] = None

    def __post_init__(self, response_format=None, regex=None, grammar=None) -> None:
        given = Constraint.of(response_format, regex, grammar)
        if given is not None and self.constraint is not None:
            raise UsageError("one constraint per request: constraint= and response_format/regex/grammar were both given")
        if given is not None:
            object.__setattr__(self, "constraint", given)
        if self.constraint is not None and not isinstance(self.constraint, Constraint):
            raise UsageError("constraint: a speclm.constraint.Constraint (or pass response_format, regex or grammar)")
        if self.logprobs is not None and (isinstance(self.logprobs, bool) or not isinstance(self.logprobs, int)
                                          or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise UsageError(f"logprobs: the alternatives returned per token, 0 to {MAX_LOGPROBS}, got {self.logprobs!r}")
        if self.constraint is not None and self.ignore_eos:
            raise UsageError("ignore-eos with a constraint: a complete output can only end (drop one of them)")
        if self.method not in REGISTRY:
            raise UsageError(f"unknown method '{self.method}' (choose from {', '.join(NAMES)})")
        if self.k is not None and self.k < 1:
            raise UsageError(f"k must be >= 1, got {self.k}")
        if self.k is not None and self.k > defaults.MAX_K:
            raise UsageError(f"k must be <= {defaults.MAX_K} (tokens drafted per round), got {self.k}")
        if self.max_new_tokens < 1:
            raise UsageError(f"max-new-tokens must be >= 1, got {self.max_new_tokens}")
        if not 1 <= self.lookup_ngram_min <= self.ngram_max:
            raise UsageError("need 1 <= ngram-min <= ngram-max")
        if self.draft_vocab is not None and self.draft_vocab < 0:
            raise UsageError(f"draft-vocab must be >= 0, got {self.draft_vocab}")
        if not self.draft_prompt_ratio >= 0:
            raise UsageError(f"draft-prompt-ratio must be >= 0, got {self.draft_prompt_ratio}")
        if self.confidence is not None and not 0 <= self.confidence < 1:
            raise UsageError(f"confidence must be in [0, 1), got {self.confidence}")
        if self.alternatives is not None and not 0 <= self.alternatives <= 1:
            raise UsageError(f"alternatives must be in [0, 1], got {self.alternatives}")
        self.sampling  # validates temperature, top-p, top-k
        m = self.spec
        if self.tree == "static" and m.tree_default != "static":
            owners = ", ".join(n for n in taking("tree") if REGISTRY[n].tree_default == "static")
            raise UsageError(f"--tree static is {owners}'s (the tuned tree shipped beside its heads)")
        if self.tree == "chain" and "chain" not in m.shapes:
            raise UsageError(f"--tree for {self.method}: auto, static or a JSON file of rank paths (it drafts trees)")
        # a method-specific option set on a method that does not take it (a chain is every chain method's shape)
        unset = {"tree": (None, "chain"), "heads": (None,), "acceptance": ("exact",), "lookahead": (None,), "layers": (None,),
                 "self_weights": (None,)}
        for option, values in unset.items():
            if getattr(self, option) not in values and option not in m.options:
                flag = f"--{option.replace('_', '-')}" + (" typical (lossy)" if option == "acceptance" else "")
                raise UsageError(f"{flag} applies to {', '.join(taking(option))}, not '{self.method}'")
        if self.acceptance not in ("exact", "typical"):
            raise UsageError(f"acceptance must be exact or typical, not '{self.acceptance}'")
        if self.lookahead is not None:
            shape = tuple(self.lookahead)
            if len(shape) != 3 or not all(isinstance(v, int) for v in shape):
                raise UsageError(f"lookahead is three integers W,N,G, got {self.lookahead!r}")
            window, ngram, guesses = shape
            if not (1 <= window <= 64 and 2 <= ngram <= 16 and 0 <= guesses <= 64):
                raise UsageError(f"lookahead W,N,G needs 1 <= W <= 64, 2 <= N <= 16, 0 <= G <= 64; got {window},{ngram},{guesses}")
            object.__setattr__(self, "lookahead", shape)
        if self.layers is not None:
            from speclm.proposers.self_draft import parse_layers

            parse_layers(self.layers)  # validates
        if self.self_weights not in (None, "target", "int4"):
            raise UsageError(f"self-weights must be target or int4, not '{self.self_weights}'")
        if self.layers is not None and self.layers.strip() == "all" and self.self_draft_weights == "target":
            raise UsageError("--layers all drafts with every layer: only on a copy (--self-weights int4)")
        self.tree_spec  # validates the tree

    @property
    def spec(self) -> Method:
        """The method's registry entry (speclm.methods)."""
        return REGISTRY[self.method]

    @property
    def tree_spec(self) -> TreeSpec | None:
        """The draft's tree (None: a chain, or a method that takes no --tree)."""
        m = self.spec
        if "tree" not in m.options:
            return None
        tree = self.tree if self.tree is not None else m.tree_default
        return parse_tree("auto" if tree == "static" else tree)  # "static": the heads' own tree, read beside them

    @property
    def self_draft_weights(self) -> str:
        """self's drafting weights: self_weights, or the default."""
        return self.self_weights or defaults.SELF_WEIGHTS

    @property
    def lookahead_shape(self) -> tuple[int, int, int]:
        """lookahead's (W, N, G), or the defaults."""
        if self.lookahead is not None:
            return self.lookahead
        return defaults.LOOKAHEAD_WINDOW, defaults.LOOKAHEAD_NGRAM, defaults.LOOKAHEAD_GUESSES

    @property
    def sampling(self) -> SamplingParams:
        return SamplingParams(self.temperature, self.top_p, self.top_k)

    def draft_length(self, quantize: str = "none", draft_quantize: str | None = None) -> int:
        """k, or the method's default for target weights `quantize` (and the draft's)."""
        if self.k is not None:
            return self.k
        return self.spec.k(Weights(quantize, draft_quantize), self)

    @property
    def lookup_ngram_min(self) -> int:
        """ngram_min, or the method's default (speclm.methods)."""
        return self.ngram_min if self.ngram_min is not None else self.spec.ngram_min

    def draft_vocabulary(self) -> int:
        """draft_vocab, or the default."""
        return defaults.DRAFT_VOCAB if self.draft_vocab is None else self.draft_vocab

    def draft_confidence(self, draft_quantize: str | None = None) -> float:
        if self.confidence is not None:
            return self.confidence
        return defaults.CONFIDENCE_INT4 if draft_quantize == "int4" else 0.0

    def draft_alternatives(self, draft_quantize: str | None = None) -> float:
        if self.alternatives is not None:
            return self.alternatives
        return defaults.ALTERNATIVES_INT4 if draft_quantize == "int4" else 0.0

    def proposer_key(self) -> "GenerationOptions":
        """What a proposer is made from (requests with equal keys share one, their rows drafted
        together): these options less those of the request alone."""
        return replace(self, max_new_tokens=1, seed=None, stop=(), chat=False, ignore_eos=False, constraint=None,
                       logprobs=None)
