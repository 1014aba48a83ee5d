"""What each CPU weight mode does to a GGUF target's predictions, against the fp32 de-quantization of
the same file (the values llama.cpp computes with): next-token argmax agreement teacher-forced over
Spec-Bench prompts (chat template), and perplexity on held-out prose (sentences of the machine's
permissively licensed text, speclm.heads.sources), for `gguf` (the file's own blocks,
speclm.quant.gguf), `int8` and `int4` (speclm.quant.weights: the fp32 values quantized again).

Run: .venv/bin/python benchmarks/gguf_quality.py [--target NAME] [--per-category 10] > gguf-quality.txt
Committed output: benchmarks/epyc/records.md#gguf-quality.
`--smoke --target FILE.gguf`: the same code path on a tiny GGUF, 2 prompts, a short text.
"""
from __future__ import annotations

import argparse
import itertools
import math

import torch

from speclm.bench.dataset import load_prompts
from speclm.heads.sources import sentences
from speclm.models.loading import load_model
from speclm.quant import gguf


@torch.inference_mode()
def predictions(model, prompts_ids: list[torch.Tensor], text_ids: torch.Tensor, window: int):
    """Each prompt's argmax per position, and the summed negative log-likelihood and token count of
    the text read in windows of `window` tokens."""
    tops = [model(input_ids=ids).logits[0].argmax(-1) for ids in prompts_ids]
    nll, count = 0.0, 0
    for lo in range(0, text_ids.shape[1] - 1, window):
        ids = text_ids[:, lo : lo + window + 1]
        logits = model(input_ids=ids[:, :-1]).logits[0].double()
        nll += float(torch.nn.functional.cross_entropy(logits, ids[0, 1:], reduction="sum"))
        count += ids.shape[1] - 1
    return tops, nll, count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="qwen2.5-coder-1.5b", help="catalog name or .gguf file")
    parser.add_argument("--modes", default="gguf,int8,int4", help="comma list of weight modes beside fp32")
    parser.add_argument("--per-category", type=int, default=10, help="Spec-Bench prompts per task kind")
    parser.add_argument("--text-tokens", type=int, default=4096, help="held-out prose tokens for perplexity")
    parser.add_argument("--smoke", action="store_true", help="2 prompts, 64 text tokens")
    args = parser.parse_args()
    per, text_tokens = (1, 64) if args.smoke else (args.per_category, args.text_tokens)
    categories = ["qa", "translation"] if args.smoke else None
    ref = load_model(args.target, progress=False)
    tok = ref.tokenizer
    prompts = [p.text for p in load_prompts("spec-bench", categories, per)]
    if tok.chat_template:
        prompts_ids = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                               return_tensors="pt", return_dict=True)["input_ids"] for p in prompts]
    else:  # a model without one (the smoke run's tiny GGUF): the prompts as they are
        prompts_ids = [tok(p, return_tensors="pt").input_ids for p in prompts]
    prose = " ".join(s.text for s in itertools.islice(sentences(seed=1), 2000))
    text_ids = tok(prose, return_tensors="pt").input_ids[:, : text_tokens + 1]
    positions = sum(ids.shape[1] for ids in prompts_ids)
    print(f"model={args.target} threads={torch.get_num_threads()} torch={torch.__version__} prompts={len(prompts)} "
          f"positions={positions} text_tokens={text_ids.shape[1] - 1}")
    ref_tops, nll, count = predictions(ref.model, prompts_ids, text_ids, 512)
    print(f"fp32 (the file's values de-quantized): perplexity {math.exp(nll / count):.4f}", flush=True)
    del ref
    modes = args.modes.split(",")
    if "gguf" in modes and not gguf.available():
        print("gguf: not measured (speclm's compiled kernels do not run here)")
        modes.remove("gguf")
    for mode in modes:
        model = load_model(args.target, quantize=mode, progress=False).model
        tops, nll, count = predictions(model, prompts_ids, text_ids, 512)
        agree = sum(int((a == b).sum()) for a, b in zip(tops, ref_tops)) / positions
        print(f"{mode}: argmax agreement with fp32 {agree:.2%} over {positions} positions; "
              f"perplexity {math.exp(nll / count):.4f}", flush=True)
        del model


if __name__ == "__main__":
    main()
