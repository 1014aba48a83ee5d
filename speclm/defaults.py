"""Every tuned default of speclm, in one table.

The engine (`GenerationOptions`), the kernels, the CLI's help, `bench` and docs/defaults.md all
read this module, so they cannot drift apart (tests/test_docs.py checks the docs' table against
`markdown_table()`). Each value names, in one line, the committed benchmark that chose it; the
runs' folders hold the command, the machine and the date. Pass the option to override a value on
other hardware. No torch import: the CLI parses its arguments before loading anything.
"""

from __future__ import annotations

from dataclasses import dataclass

@dataclass(frozen=True)
class Tuned:
    name: str  # the constant's name in this module
    value: int | float | str
    option: str  # the CLI option (or the part of speclm) it sets
    applies: str  # where it applies
    run: str  # the committed benchmark that chose it (or, untuned, the run it was measured at): under benchmarks/
    result: str  # what that run measured, in a few words ("not tuned": no other value was measured)


TABLE: tuple[Tuned, ...] = (
    Tuned("K_DRAFT", 2, "--k", "`draft`, `draft+pld`: tokens drafted per round (fp32 or int8 draft)",
          "benchmarks/intel/cpu-fp32-qwen1.5b-1x6-k2", "k=2 1.17x; k=4 0.92x (44a4c5c:benchmarks/intel/cpu-fp32-qwen1.5b-1x6)"),
    Tuned("K_DRAFT_INT4", 6, "--k", "the same with an int4 draft",
          "benchmarks/intel/int4-draft-k-cpu", "k=6 at confidence 0.6: 1.39x; k=4: 1.31x"),
    Tuned("CONFIDENCE_INT4", 0.6, "--confidence", "int4 draft: a round stops after a token drafted below this "
          "probability (else 0: never)", "benchmarks/epyc/records.md#draft-policy", "replayed over three runs"),
    Tuned("ALTERNATIVES_INT4", 0.6, "--alternatives", "int4 draft: such a token gets its second choice verified "
          "beside it (else 0: never)", "benchmarks/epyc/records.md#draft-policy", "replayed on a run with alternatives (44a4c5c:benchmarks/epyc/alternatives-int8-qwen1.5b-73caf26)"),
    Tuned("DRAFT_VOCAB", 65536, "--draft-vocab", "`draft`, `draft+pld`: the draft scores this many lowest ids + the "
          "prompt's + EOS (0: all)", "benchmarks/epyc/reference-int8-qwen1.5b", "draft:vocab=0 beside it; c 0.182 -> 0.166"),
    Tuned("K_PLD", 2, "--k", "`pld`: tokens looked up per round, fp32 weights",
          "benchmarks/intel/cpu-fp32-qwen1.5b-1x6-k2", "k=2 1.21x; k=4 0.97x (44a4c5c:benchmarks/intel/cpu-fp32-qwen1.5b-1x6)"),
    Tuned("K_PLD_QUANTIZED", 4, "--k", "`pld` on int8 or int4 weights, and `draft+pld`'s lookup there",
          "benchmarks/intel/reference-cpu-int8-qwen1.5b-d6f1c9f", "k=4 1.28x, k=6 1.22x"),
    Tuned("NGRAM_MAX", 3, "--ngram-max", "`pld`, `draft+pld`: longest trailing n-gram matched",
          "benchmarks/epyc/records.md#draft-policy", "n-grams 2-3 and 1-5 within a few percent"),
    Tuned("NGRAM_MIN_DRAFT_PLD", 2, "--ngram-min", "`draft+pld`: a row drafts by lookup when this many trailing "
          "tokens recur (`pld`: 1)", "benchmarks/epyc/methods-int8-qwen1.5b-d395ee1", "draft+pld at 2: 1.42x none, draft 1.30x, pld 1.20x (18 prompts)"),
    Tuned("DRAFT_PROMPT_RATIO", 3.0, "--draft-prompt-ratio", "`draft+pld`: no draft model for prompts longer than "
          "this times max_new_tokens", "benchmarks/epyc/methods-int8-qwen1.5b-d395ee1/other18", "18 prompts outside the rule's sample: draft+pld 1.54x none, draft 1.31x, pld 1.35x"),
    Tuned("COST_REPEATS", 40, "speclm.forward.costs", "forwards timed per size for the verification-cost table that "
          "sizes trees, heads' node budgets and adaptive speculation (measured once per model and kernel build)",
          "benchmarks/amx/records.md#cost-table-noise", "v(8) 1.10-1.53, v(16) 1.16-1.66 over 32 tables of 5 forwards; 1.29-1.33, 1.49-1.52 over 4 of 40"),
    Tuned("PREFIX_CACHE_TOKENS", 4096, "--prefix-cache", "keys and values of recent prompts kept per model "
          "(about 230 MB for the 1.5B)", "benchmarks/epyc/records.md#prefix-cache", "what a cached chat head saves"),
    Tuned("PREFILL_ROW_BLOCK", 256, "speclm.forward.lean", "a long feed's row-wise work (norms, projections, MLP) runs in "
          "blocks of this many rows", "benchmarks/intel/records.md#prefill-cpu", "1000 tokens: 5.2 s against 6.9 s unblocked"),
    Tuned("FP32_FEW_ROWS", 256, "speclm.forward.lean", "fp32 CPU weights: linear layers over up to this many rows (a "
          "prefill block at most) run as (W x^T)^T, not x W^T", "benchmarks/avx2/records.md#fp32-linear-rows",
          "4 rows 3.2x faster, 256 rows 1.05x"),
    Tuned("VNNI_MAX_ROWS", 32, "speclm.quant.weights", "with SPECLM_ONEDNN=1, int8 GEMMs of up to this many rows run on "
          "speclm's kernel, more on oneDNN's (by default speclm's kernel runs every row count)", "benchmarks/epyc/records.md#int8-gemm-rows", "faster up to 32 rows, even at 64"),
    Tuned("AMX_MIN_ROWS", 10, "speclm/quant/csrc", "int8 GEMMs of this many rows or more run on AMX tiles where "
          "the CPU has them (the same integers as the VNNI loop's)", "benchmarks/amx/records.md#forward-rows",
          "from 2 rows the target's forward over 2-6 tokens took 0.87-1.09x the time alone and 0.97-1.18x after "
          "draft steps, as in a round, when memory was slow; 0.81-0.97x alone when fast (44a4c5c:benchmarks/amx/forward-rows-b18d196.txt)"),
    Tuned("AMX_MIN_ROWS_INT4", 10, "speclm/quant/csrc", "int4 GEMMs (draft models) of this many rows or more run on "
          "AMX tiles where the CPU has them", "benchmarks/amx/records.md#int4-gemm-rows",
          "AMX / VNNI time 0.96-1.23 at 1-6 rows, 0.67-0.91 from 7 (two runs); 7-9 rows not tried end to end"),
    Tuned("ATTENTION_QUERY_TILE", 64, "speclm/quant/csrc", "queries of a kv head per tile in the compiled attention",
          "benchmarks/epyc/records.md#prefill-kernels", "969 tokens: 0.60 s against 0.92 s untiled"),
    Tuned("ATTENTION_SLOT_BLOCK", 32, "speclm/quant/csrc", "cached slots per block in the compiled attention (16 KB of "
          "keys at head size 128: L1)", "benchmarks/intel/records.md#decode-attention-cpu", "the kernel as built"),
    Tuned("WEIGHT_PREFETCH_BYTES", 2048, "speclm/quant/csrc", "software prefetch distance in the int8 kernel's weight "
          "stream", "benchmarks/epyc/records.md#int8-gemm-rows", "the kernel as built; the run without it is not committed"),
    Tuned("FAR_PREFETCH_BYTES", 65536, "speclm/quant/csrc", "Intel CPUs (0 elsewhere, not measured on AMD): the "
          "AVX-512 kernels' few-row GEMMs (int8 up to 6 rows and on AMX tiles 10-16, int4's VNNI loop) also prefetch one "
          "line per 256 bytes of weights this far ahead into L2; SPECLM_FAR_PREFETCH sets it",
          "benchmarks/amx/records.md#far-prefetch-ab", "int8 GEMMs 0.89-0.94x the time at 1-6 rows, 0.91-0.99x at 10-16 (3 runs), "
          "int4 0.92-0.96x (paired)"),
    Tuned("KQ_FAR_PREFETCH_BYTES", 16384, "speclm/quant/csrc", "`--quantize gguf`: the GGUF-block kernel's passes also "
          "prefetch their weight stream this far ahead into L2", "benchmarks/epyc/records.md#gguf-rows",
          "6 rows / 1 row 1.18x and 1.04x (two runs) against 1.26x without; 8-32 KB with a 2-4 KB L1 distance "
          "0.99-1.31x (runs apart, not paired: the memory's speed drifts)"),
    Tuned("LOOKAHEAD_WINDOW", 1, "--lookahead", "`lookahead`: W, the window's guesses per Jacobi level",
          "benchmarks/avx2/lookahead-self-int8-qwen1.5b-12", "W,N,G 1,2,1 0.98x none; 2,2,2 0.96x; 2,3,1 0.70x; 4,3,2 "
          "0.50x: a forward over their 3-13 tokens cost 1.24-3.64x a step, for 1.20-1.46 tokens"),
    Tuned("LOOKAHEAD_NGRAM", 2, "--lookahead", "`lookahead`: N, the n-grams' size (N - 1 tokens verified after the last one)",
          "benchmarks/avx2/lookahead-self-int8-qwen1.5b-12", "as LOOKAHEAD_WINDOW"),
    Tuned("LOOKAHEAD_GUESSES", 1, "--lookahead", "`lookahead`: G, pooled n-grams verified per round",
          "benchmarks/avx2/lookahead-self-int8-qwen1.5b-12", "as LOOKAHEAD_WINDOW"),
    Tuned("WEIGHT_PREFETCH_BYTES_AVX2_ONE_ROW", 1024, "speclm/quant/csrc", "the same distance in the AVX2 int8 kernel "
          "for one row (a decode step without speculation)", "benchmarks/avx2/records.md#int8-prefetch-ab",
          "1 row: 0.91x the time at 2048, paired (2 and 4 rows, the same code: 0.99-1.03x)"),
    Tuned("TREE", "chain", "--tree", "`draft`, `draft+pld`: chain, or auto (a tree grown each round)",
          "benchmarks/epyc/kernel-int8-qwen1.5b-60", "auto 0.98x the chain (`draft`), 0.99x (`draft+pld`); 0.98-0.99x on three other CPUs (docs/methods.md)"),
    Tuned("TREE_DEPTH", 6, "--tree auto", "levels below the root", "benchmarks/epyc/kernel-int8-qwen1.5b-60", "not tuned: the auto tree measured there"),
    Tuned("TREE_BRANCH", 4, "--tree auto", "children per expanded node", "benchmarks/epyc/kernel-int8-qwen1.5b-60", "not tuned"),
    Tuned("TREE_EXPAND", 3, "--tree auto", "nodes expanded per level", "benchmarks/epyc/kernel-int8-qwen1.5b-60", "not tuned"),
    Tuned("TREE_MIN_PROB", 0.05, "--tree auto", "batches: a node below this cumulative probability is not expanded",
          "benchmarks/epyc/kernel-int8-qwen1.5b-60", "not tuned"),
    Tuned("TREE_FOLLOW", 0.6, "--tree auto", "greedy: a level's likeliest node is expanded where the draft gave it this "
          "much (the chain's confidence rule)", "benchmarks/epyc/kernel-int8-qwen1.5b-60", "not tuned"),
    Tuned("MEDUSA_TREE", "static", "--tree", "`medusa`: static (the tuned tree shipped beside the heads, cut each round "
          "by the cost line) or auto", "benchmarks/epyc/heads-int8-qwen1.5b-60-8979d96",
          "static 1.13x none, auto the same (4.96 nodes verified a forward each)"),
    Tuned("K_MEDUSA", 4, "--k", "`medusa`: the deepest draft", "benchmarks/epyc/heads-int8-qwen1.5b-60-2abceb7", "not tuned: one level per head trained"),
    Tuned("MEDUSA_BRANCH", 8, "speclm.proposers.medusa", "a grown tree's candidates per head", "benchmarks/epyc/heads-int8-qwen1.5b-60-2abceb7",
          "not tuned"),
    Tuned("MEDUSA_MAX_TREE", 48, "speclm.proposers.medusa", "a grown tree's most nodes (the cost line cuts it)",
          "benchmarks/epyc/heads-int8-qwen1.5b-60-2abceb7", "not tuned"),
    Tuned("K_EAGLE", 6, "--k", "`eagle`, `eagle+pld`: levels below the root", "benchmarks/epyc/heads-pld-int8-qwen1.5b-60-6116de4", "not tuned"),
    Tuned("EAGLE_EXPAND", 4, "speclm.proposers.eagle", "candidates run through the head per level", "benchmarks/epyc/heads-pld-int8-qwen1.5b-60-6116de4",
          "not tuned"),
    Tuned("EAGLE_BRANCH", 4, "speclm.proposers.eagle", "children kept per run candidate", "benchmarks/epyc/heads-pld-int8-qwen1.5b-60-6116de4", "not tuned"),
    Tuned("EAGLE_MAX_TREE", 48, "speclm.proposers.eagle", "the most nodes a tree holds (the cost line cuts it)",
          "benchmarks/epyc/heads-pld-int8-qwen1.5b-60-6116de4", "not tuned"),
    Tuned("EAGLE_MIN_PROB", 0.2, "speclm.proposers.eagle", "a level grows only while its likeliest candidate has this "
          "cumulative probability", "benchmarks/epyc/records.md#eagle-levels",
          "12 prompts: 0.02 1.10x none, 0.1 1.15x, 0.2 1.19x, 0.35 1.20x"),
    Tuned("ADAPTIVE_PRIOR", 0.6, "speclm.round.adaptive", "adaptive speculation: a request's draft acceptance before "
          "its rounds say", "benchmarks/avx2/records.md#adaptive-ab", "not tuned: the policy measured there (8 rows, "
          "draft+pld 1.00x none)"),
    Tuned("ADAPTIVE_DECAY", 0.9, "speclm.round.adaptive", "adaptive speculation: each round's weight on the counts "
          "before it", "benchmarks/avx2/records.md#adaptive-ab", "not tuned"),
    Tuned("DRAFT_ROW_PREMIUM", 0.06, "speclm.round.adaptive", "auto: a drafting round's ratio of seconds to its "
          "forward's table price over a plain round's, before both ran at a size: 1 + this a row past the first",
          "benchmarks/amx/records.md#batch-generate", "not tuned: drafting over plain rounds' ratios measured there, 1.20 at 4 rows, 1.27 at 8 (this default: 1.18, 1.42)"),
    Tuned("K_SELF", 3, "--k", "`self`: tokens its layers draft per round", "benchmarks/avx2/self-ab-int8-qwen1.5b-12",
          "on the int4 copy of every layer, two runs: k=3 1.16x, 1.08x none; k=5 1.08x, 1.14x (2f6cb47's: 1.11-1.13x, 1.07x)"),
    Tuned("SELF_WEIGHTS", "int4", "--self-weights", "`self`: the weights its layers draft with: int4 (a copy of "
          "those layers and the head, where int4 layers run) or target (its own)", "benchmarks/avx2/self-ab-int8-qwen1.5b-12",
          "int4, every layer: 1.08x none; the target's own, 21 layers: 0.89x (6d08aa4's: 21 layers 1.07x, 0.87x)"),
    Tuned("SELF_VOCAB", 0, "--draft-vocab", "`self`: its head scores this many lowest ids + the prompt's + EOS "
          "(0: all)", "benchmarks/avx2/self-ab-int8-qwen1.5b-12", "undecided: 0 1.16x, 1.08x none; 65536 1.12x, 1.22x"),
    Tuned("LOOKAHEAD_POOL", 8, "speclm.proposers.lookahead", "`lookahead`: n-grams its pool keeps per first token "
          "(G of them are verified)", "benchmarks/avx2/lookahead-self-int8-qwen1.5b-12", "not tuned"),
)

_BY_NAME = {t.name: t.value for t in TABLE}
K_DRAFT: int = _BY_NAME["K_DRAFT"]
K_DRAFT_INT4: int = _BY_NAME["K_DRAFT_INT4"]
CONFIDENCE_INT4: float = _BY_NAME["CONFIDENCE_INT4"]
ALTERNATIVES_INT4: float = _BY_NAME["ALTERNATIVES_INT4"]
DRAFT_VOCAB: int = _BY_NAME["DRAFT_VOCAB"]
K_PLD: int = _BY_NAME["K_PLD"]
K_PLD_QUANTIZED: int = _BY_NAME["K_PLD_QUANTIZED"]
NGRAM_MAX: int = _BY_NAME["NGRAM_MAX"]
NGRAM_MIN_DRAFT_PLD: int = _BY_NAME["NGRAM_MIN_DRAFT_PLD"]
DRAFT_PROMPT_RATIO: float = _BY_NAME["DRAFT_PROMPT_RATIO"]
PREFIX_CACHE_TOKENS: int = _BY_NAME["PREFIX_CACHE_TOKENS"]
COST_REPEATS: int = _BY_NAME["COST_REPEATS"]
PREFILL_ROW_BLOCK: int = _BY_NAME["PREFILL_ROW_BLOCK"]
FP32_FEW_ROWS: int = _BY_NAME["FP32_FEW_ROWS"]
VNNI_MAX_ROWS: int = _BY_NAME["VNNI_MAX_ROWS"]
AMX_MIN_ROWS: int = _BY_NAME["AMX_MIN_ROWS"]
AMX_MIN_ROWS_INT4: int = _BY_NAME["AMX_MIN_ROWS_INT4"]
ATTENTION_QUERY_TILE: int = _BY_NAME["ATTENTION_QUERY_TILE"]
ATTENTION_SLOT_BLOCK: int = _BY_NAME["ATTENTION_SLOT_BLOCK"]
WEIGHT_PREFETCH_BYTES: int = _BY_NAME["WEIGHT_PREFETCH_BYTES"]
WEIGHT_PREFETCH_BYTES_AVX2_ONE_ROW: int = _BY_NAME["WEIGHT_PREFETCH_BYTES_AVX2_ONE_ROW"]
FAR_PREFETCH_BYTES: int = _BY_NAME["FAR_PREFETCH_BYTES"]
KQ_FAR_PREFETCH_BYTES: int = _BY_NAME["KQ_FAR_PREFETCH_BYTES"]

# fp32 CPU weights: rows -> the rows a linear layer's GEMM runs over, zero rows added (speclm.forward.lean). MKL's
# (W x^T)^T over 4 rows cost what 1 row does on the AVX2 machine, over 3 rows 1.45x; 13-15 rows 1.6-2.0x
# 16 rows' (benchmarks/avx2/records.md#fp32-linear-rows, the padded column)
FP32_PADDED_ROWS = {2: 4, 3: 4, 13: 16, 14: 16, 15: 16}

# --k's bound: acceptance decays with draft position (the tuned k are 2-6), so more drafts only widen verification
MAX_K = 64

# The compiled kernels take their tuned sizes as macros (speclm.quant.kernels adds them to the build).
KERNEL_MACROS = {
    "SPECLM_QUERY_TILE": ATTENTION_QUERY_TILE,
    "SPECLM_SLOT_BLOCK": ATTENTION_SLOT_BLOCK,
    "SPECLM_PREFETCH": WEIGHT_PREFETCH_BYTES,
    "SPECLM_AMX_MIN_ROWS": AMX_MIN_ROWS,
    "SPECLM_AMX_MIN_ROWS_INT4": AMX_MIN_ROWS_INT4,
    "SPECLM_PREFETCH_ONE_ROW": WEIGHT_PREFETCH_BYTES_AVX2_ONE_ROW,
    "SPECLM_KQ_FAR": KQ_FAR_PREFETCH_BYTES,
}


LOOKAHEAD_WINDOW: int = _BY_NAME["LOOKAHEAD_WINDOW"]
LOOKAHEAD_NGRAM: int = _BY_NAME["LOOKAHEAD_NGRAM"]
LOOKAHEAD_GUESSES: int = _BY_NAME["LOOKAHEAD_GUESSES"]

TREE: str = _BY_NAME["TREE"]
TREE_DEPTH: int = _BY_NAME["TREE_DEPTH"]
TREE_BRANCH: int = _BY_NAME["TREE_BRANCH"]
TREE_EXPAND: int = _BY_NAME["TREE_EXPAND"]
TREE_MIN_PROB: float = _BY_NAME["TREE_MIN_PROB"]
TREE_FOLLOW: float = _BY_NAME["TREE_FOLLOW"]
MEDUSA_TREE: str = _BY_NAME["MEDUSA_TREE"]
K_MEDUSA: int = _BY_NAME["K_MEDUSA"]
MEDUSA_BRANCH: int = _BY_NAME["MEDUSA_BRANCH"]
MEDUSA_MAX_TREE: int = _BY_NAME["MEDUSA_MAX_TREE"]
K_EAGLE: int = _BY_NAME["K_EAGLE"]
EAGLE_EXPAND: int = _BY_NAME["EAGLE_EXPAND"]
EAGLE_BRANCH: int = _BY_NAME["EAGLE_BRANCH"]
EAGLE_MAX_TREE: int = _BY_NAME["EAGLE_MAX_TREE"]
EAGLE_MIN_PROB: float = _BY_NAME["EAGLE_MIN_PROB"]
ADAPTIVE_PRIOR: float = _BY_NAME["ADAPTIVE_PRIOR"]
ADAPTIVE_DECAY: float = _BY_NAME["ADAPTIVE_DECAY"]
DRAFT_ROW_PREMIUM: float = _BY_NAME["DRAFT_ROW_PREMIUM"]
K_SELF: int = _BY_NAME["K_SELF"]
SELF_WEIGHTS: str = _BY_NAME["SELF_WEIGHTS"]
SELF_VOCAB: int = _BY_NAME["SELF_VOCAB"]
LOOKAHEAD_POOL: int = _BY_NAME["LOOKAHEAD_POOL"]


def k_help(draft_model_only: bool = False) -> str:
    """--k's help: for a draft model alone (the demo's), or for every method."""
    text = f"draft tokens per round (default {K_DRAFT}, {K_DRAFT_INT4} with an int4 draft"
    return text + (")" if draft_model_only else f"; pld: {K_PLD}, {K_PLD_QUANTIZED} on int8/int4 weights)")


def markdown_table() -> str:
    """The table as docs/defaults.md shows it (links relative to docs/)."""
    rows = ["| default | value | option | applies to | chosen by |", "|---|---|---|---|---|"]
    rows += [f"| `{t.name}` | {t.value if isinstance(t.value, str) else format(t.value, 'g')} | `{t.option}` | {t.applies} | [{t.run.removeprefix('benchmarks/')}](../{t.run}): "
             f"{t.result} |" for t in TABLE]
    return "\n".join(rows)
