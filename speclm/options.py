"""`generate`-style options of one request, validated where they are made; the method's tuned
defaults (speclm.defaults) are resolved here, in one place."""

from __future__ import annotations

from dataclasses import dataclass, replace

from speclm import defaults
from speclm.defaults import DRAFT_METHODS, HEAD_METHODS, METHODS
from speclm.errors import UsageError
from speclm.proposers.draft_tree import TreeSpec, parse_tree
from speclm.sampling import SamplingParams


@dataclass(frozen=True)
class GenerationOptions:
    """`generate`-style arguments."""

    method: str = "none"  # none | draft | pld | draft+pld | medusa | eagle | eagle+pld
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
    # None: speclm.defaults.confidence, 0.6 with an int4 draft, else 0)
    confidence: float | None = None
    # draft: a drafted token the draft gave less probability than this gets a second candidate
    # verified beside it (0: never; None: speclm.defaults.alternatives, 0.6 with an int4 draft, else 0)
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
    # temperature > 0 (speclm.spec.verify.typical_paths); head methods only
    acceptance: str = "exact"

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise UsageError(f"unknown method '{self.method}' (choose from {', '.join(METHODS)})")
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
        if self.tree == "static" and self.method != "medusa":
            raise UsageError("--tree static is medusa's (the tuned tree shipped beside its heads)")
        if self.tree is not None and self.method not in DRAFT_METHODS + ("medusa",) and self.tree != "chain":
            raise UsageError(f"--tree applies to {', '.join(DRAFT_METHODS)} and medusa, not '{self.method}'")
        if self.method == "medusa" and self.tree == "chain":
            raise UsageError("--tree for medusa: auto, static or a JSON file of rank paths (its heads draft trees)")
        if self.acceptance not in ("exact", "typical"):
            raise UsageError(f"acceptance must be exact or typical, not '{self.acceptance}'")
        if self.acceptance == "typical" and self.method not in HEAD_METHODS:
            raise UsageError(f"--acceptance typical (lossy) applies to {', '.join(HEAD_METHODS)}, not '{self.method}'")
        if self.heads is not None and self.method not in HEAD_METHODS:
            raise UsageError(f"--heads applies to {', '.join(HEAD_METHODS)}, not '{self.method}'")
        self.tree_spec  # validates the tree

    @property
    def tree_spec(self) -> TreeSpec | None:
        """The draft's tree (None: a chain)."""
        if self.method == "medusa":  # "static": the heads' own tuned tree, which the engine reads beside them
            tree = self.medusa_tree
            return parse_tree("auto" if tree == "static" else tree)
        if self.method not in DRAFT_METHODS:
            return None
        return parse_tree(self.tree if self.tree is not None else defaults.TREE)

    @property
    def medusa_tree(self) -> str:
        """medusa's tree: auto, static or a file (the default: speclm.defaults.MEDUSA_TREE)."""
        return self.tree if self.tree is not None else defaults.MEDUSA_TREE

    @property
    def sampling(self) -> SamplingParams:
        return SamplingParams(self.temperature, self.top_p, self.top_k)

    def draft_length(self, quantize: str = "none", draft_quantize: str | None = None) -> int:
        """k, or the method's default for target weights `quantize` (and the draft's)."""
        return self.k if self.k is not None else defaults.k(self.method, quantize, draft_quantize)

    @property
    def lookup_ngram_min(self) -> int:
        """ngram_min, or the method's default (speclm.defaults.ngram_min)."""
        return self.ngram_min if self.ngram_min is not None else defaults.ngram_min(self.method)

    def draft_vocabulary(self) -> int:
        """draft_vocab, or the default."""
        return defaults.DRAFT_VOCAB if self.draft_vocab is None else self.draft_vocab

    def draft_confidence(self, draft_quantize: str | None = None) -> float:
        return self.confidence if self.confidence is not None else defaults.confidence(draft_quantize)

    def draft_alternatives(self, draft_quantize: str | None = None) -> float:
        return self.alternatives if self.alternatives is not None else defaults.alternatives(draft_quantize)

    def proposer_key(self) -> "GenerationOptions":
        """What a proposer is made from (requests with equal keys share one, their rows drafted
        together): these options less those of the request alone."""
        return replace(self, max_new_tokens=1, seed=None, stop=(), chat=False, ignore_eos=False)
