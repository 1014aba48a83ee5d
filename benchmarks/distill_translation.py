"""German-to-English prompts for `speclm draft distill`, made without Spec-Bench, from one of two
sources (`--source`):
- docstrings: English prose sentences from this machine's permissively licensed text
  (speclm.heads.sources.sentences: the Python standard library's and MIT/BSD/Apache packages'
  docstrings), one or two at a time, translated into German by the target itself;
- news: German news-agency sentences the target writes itself about a topic made of an event and a
  place from the lists below (written here, not taken from any corpus), closer to Spec-Bench's
  translation prompts (news German) than docstrings are.
The target runs greedy, in its chat template; each German text becomes a prompt in Spec-Bench's
translation wording ("Translate German to English: ..."), the task kind the stock draft handles
worst. Prompts that overlap Spec-Bench (speclm.heads.data's EvalIndex) are left out; each line
keeps its text's source (and a docstring's licence).

Run: .venv/bin/python benchmarks/distill_translation.py --out prompts-de-en.jsonl --prompts 300 [--source news]
then: speclm draft distill --prompts prompts-de-en.jsonl --out runs/draft-de-en ...
`--smoke --target FOLDER`: 4 prompts, 8 new tokens, one thread.
"""
from __future__ import annotations

import argparse
import json
import random
import re
import sys
import time
from pathlib import Path

ASK = "Translate the following English text into German. Reply with the German translation only.\n\n{}"
ASK_NEWS = "Write {length} of a news agency report, in German, about {event} in {place}. Reply with the German text only."
EVENTS = (
    "a strike by railway workers", "the central bank's decision on interest rates", "a football match in the national league",
    "a court ruling on data protection", "floods after days of heavy rain", "the elections for the state parliament",
    "a new law on rents", "a fire in an apartment building", "a car maker's quarterly results", "a climate protest",
    "the opening of a museum", "a dispute inside the governing coalition", "rising energy prices",
    "a police investigation into a bank robbery", "a state visit by a foreign president", "a study on dementia",
    "a tennis final", "an accident on the motorway", "last month's unemployment figures", "a shortage of nurses",
    "a new airport terminal", "the budget debate in parliament", "a music festival", "a cyber attack on a city's offices",
    "a heat wave", "a cycling race", "the trial of a former minister", "a company's plan to cut jobs",
    "refugees arriving at the border", "a school reform", "a ski race", "a film prize", "a storm that cut power to homes",
    "a merger of two banks", "a doping scandal", "a derailed train", "talks on a trade agreement", "rising house prices",
    "a new vaccine", "a summit of European leaders")
PLACES = (
    "Berlin", "Hamburg", "Munich", "Cologne", "Frankfurt", "Stuttgart", "Dresden", "Leipzig", "Vienna", "Zurich",
    "Brussels", "Paris", "London", "Washington", "Warsaw", "Rome", "Madrid", "Bavaria", "Saxony", "Lower Saxony",
    "the Ruhr area", "Austria", "Switzerland", "Greece", "Turkey", "China", "Brazil", "Ukraine", "Scotland", "Japan")
LENGTHS = ("one sentence", "two sentences")
GERMAN_WORDS = frozenset("der die das und ist nicht mit den dem von zu im auf für sich ein eine wurde hat werden sind "
                         "nach bei am auch".split())
WORDING = "Translate German to English: {}"  # Spec-Bench's translation prompts' own wording


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="qwen2.5-coder-1.5b", help="the model that translates (catalog name or folder)")
    parser.add_argument("--out", required=True, help="the JSON-lines file to write")
    parser.add_argument("--prompts", type=int, default=300, help="prompts to write")
    parser.add_argument("--source", choices=("docstrings", "news"), default="docstrings",
                        help="what the German is made of (the module's help)")
    parser.add_argument("--seed", type=int, default=0, help="which sentences or topics, and their order")
    parser.add_argument("--smoke", action="store_true", help="4 prompts, 8 new tokens, one thread")
    return parser.parse_args()


def german(text: str, english: str) -> str | None:
    """The translation as a prompt's text, or None where the answer is not a plain translation."""
    text = text.strip().strip('"').strip()
    if not text or "\n" in text or text == english or text.lower().startswith(("translation", "german", "hier")):
        return None
    return text if len(text.split()) >= 3 else None


def news(text: str) -> str | None:
    """A written news text as a prompt's text (its lines joined), or None where it is not plain German prose."""
    text = " ".join(line.strip() for line in text.strip().splitlines() if line.strip()).strip('"').strip()
    words = re.findall(r"\w+", text.lower())
    if not 6 <= len(words) <= 90 or any(c in text for c in "`#*|<>") or text.lower().startswith(("hier", "here", "sure")):
        return None
    return text if sum(w in GERMAN_WORDS for w in words) >= 2 else None


def news_topics(seed: int):
    """(task, None: no English source, what) for every event, place and length, in a fixed order for `seed`."""
    topics = [(e, p, n) for e in EVENTS for p in PLACES for n in LENGTHS]
    random.Random(f"speclm-news/{seed}").shuffle(topics)
    for event, place, length in topics:
        yield ASK_NEWS.format(length=length, event=event, place=place), None, f"{event} / {place} / {length}"


def docstring_tasks(seed: int):
    """(task, English text, its first sentence) for the docstrings' sentences, one or two at a time."""
    from speclm.heads.sources import sentences

    rng = random.Random(seed)
    stream = sentences(seed)
    while (first := next(stream, None)) is not None:
        second = next(stream, None) if rng.random() < 0.5 else None
        english = first.text + (" " + second.text if second is not None else "")
        yield ASK.format(english), english, first


def main() -> int:
    args = arguments()
    import torch
    from tqdm import tqdm

    from speclm.engine import SpecEngine
    from speclm.heads.data import eval_index
    from speclm.models.loading import load_model
    from speclm.runtime import weights_for

    if args.smoke:
        torch.set_num_threads(1)
    want, new_tokens = (4, 8) if args.smoke else (args.prompts, 96 if args.source == "news" else 160)
    started = time.monotonic()
    engine = SpecEngine(load_model(args.target, quantize=weights_for("auto")[0]))
    tasks = news_topics(args.seed) if args.source == "news" else docstring_tasks(args.seed)
    index = eval_index()
    written, skipped, lines = 0, 0, []
    bar = tqdm(total=want, unit="prompt", desc="prompts", disable=args.smoke)
    while written < want:
        batch = [t for _, t in zip(range(16), tasks)]
        if not batch:
            break
        outs = engine.generate([task for task, _, _ in batch], chat=True, method="none", max_new_tokens=new_tokens)
        for (_, english, origin), out in zip(batch, outs):
            if written >= want:
                break
            if args.smoke:
                text = (out.text.strip() or "?") + " Hallo Welt"
            else:
                text = news(out.text) if english is None else german(out.text, english)
            prompt = WORDING.format(text) if text else None
            if prompt is None or index.hits(prompt):
                skipped += 1
                continue
            line = ({"prompt": prompt, "topic": origin, "source": "written by the target"} if english is None else
                    {"prompt": prompt, "english": english, "source": origin.source, "licence": origin.licence})
            lines.append(json.dumps(line, ensure_ascii=False))
            written += 1
            bar.update()
    bar.close()
    Path(args.out).write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    print(f"{written} prompts written to {args.out} ({skipped} left out: not plain German, or overlapping "
          f"Spec-Bench) in {time.monotonic() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
