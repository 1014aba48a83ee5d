"""German-to-English prompts for `speclm draft distill`, made without Spec-Bench: English prose
sentences from this machine's permissively licensed text (speclm.heads.sources.sentences: the
Python standard library's and MIT/BSD/Apache packages' docstrings), one or two at a time, are
translated into German by the target itself (greedy, its chat template), and each German text
becomes a prompt in Spec-Bench's translation wording ("Translate German to English: ..."), the
task kind the stock draft handles worst. Prompts that overlap Spec-Bench (speclm.heads.data's
EvalIndex) are left out; each line keeps its sentence's source and licence.

Run: .venv/bin/python benchmarks/distill_translation.py --out prompts-de-en.jsonl --prompts 300
then: speclm draft distill --prompts prompts-de-en.jsonl --out runs/draft-de-en ...
`--smoke --target FOLDER`: 4 prompts, 8 new tokens, one thread.
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

ASK = "Translate the following English text into German. Reply with the German translation only.\n\n{}"
WORDING = "Translate German to English: {}"  # Spec-Bench's translation prompts' own wording


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="qwen2.5-coder-1.5b", help="the model that translates (catalog name or folder)")
    parser.add_argument("--out", required=True, help="the JSON-lines file to write")
    parser.add_argument("--prompts", type=int, default=300, help="prompts to write")
    parser.add_argument("--seed", type=int, default=0, help="which sentences, and which are paired")
    parser.add_argument("--smoke", action="store_true", help="4 prompts, 8 new tokens, one thread")
    return parser.parse_args()


def german(text: str, english: str) -> str | None:
    """The translation as a prompt's text, or None where the answer is not a plain translation."""
    text = text.strip().strip('"').strip()
    if not text or "\n" in text or text == english or text.lower().startswith(("translation", "german", "hier")):
        return None
    return text if len(text.split()) >= 3 else None


def main() -> int:
    args = arguments()
    import torch

    from speclm.engine import SpecEngine
    from speclm.heads.data import eval_index
    from speclm.heads.sources import sentences
    from speclm.models.loading import load_model
    from speclm.runtime import weights_for

    if args.smoke:
        torch.set_num_threads(1)
    want, new_tokens = (4, 8) if args.smoke else (args.prompts, 160)
    started = time.monotonic()
    engine = SpecEngine(load_model(args.target, quantize=weights_for("auto")[0]))
    rng = random.Random(args.seed)
    stream = sentences(args.seed)
    index = eval_index()
    written, skipped, lines = 0, 0, []
    while written < want:
        batch = []
        for _ in range(16):
            first = next(stream, None)
            if first is None:
                break
            second = next(stream, None) if rng.random() < 0.5 else None
            batch.append((first, first.text + (" " + second.text if second is not None else "")))
        if not batch:
            break
        outs = engine.generate([ASK.format(text) for _, text in batch], chat=True, method="none",
                               max_new_tokens=new_tokens)
        for (unit, english), out in zip(batch, outs):
            text = german(out.text, english) if not args.smoke else (out.text.strip() or "?") + " Hallo Welt"
            prompt = WORDING.format(text) if text else None
            if prompt is None or index.hits(prompt) or written >= want:
                skipped += 1
                continue
            lines.append(json.dumps({"prompt": prompt, "english": english, "source": unit.source,
                                     "licence": unit.licence}, ensure_ascii=False))
            written += 1
    Path(args.out).write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    print(f"{written} prompts written to {args.out} ({skipped} translations left out: not a plain translation, "
          f"or overlapping Spec-Bench) in {time.monotonic() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
