"""General-domain training prompts written by the target itself (self-instruct), for
`speclm heads data --source assistant`.

The library source (speclm.heads.sources) draws every prompt from software text, and heads
trained on it learn software-flavoured answers: on Spec-Bench's chat, news and Wikipedia-style
prompts their top-1 accuracy falls far below what it is on held-out training prompts. No
general-domain prompt set is available offline, so the target writes one: each *seed request*
(a domain from DOMAINS with a style from STYLES, speclm's own templates) asks it for a numbered
list of user requests of that style about that domain; every parsed line becomes a prompt
(translation lines are wrapped in a translation instruction). The target's greedy answers to
those prompts are the training data, as for any source.

Seed requests run in a fixed order for a seed, and their answers (the lists) are kept in
`requests.jsonl` in the data folder, so a continued build reuses them instead of decoding them
again. Provenance: source "speclm-assistant:<style>:<domain>", licence Apache-2.0 (speclm's
templates; the text is the default target's output, Qwen2.5-Coder, Apache-2.0).
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path
from typing import Callable, Iterator

from speclm.heads.sources import Prompt

SOURCE = "speclm-assistant"
LICENCE = "Apache-2.0"
FILE = "requests.jsonl"
MAX_NEW_TOKENS = 320  # a seed request's answer: about ten requests
PER_LIST = 10

DOMAINS = (
    "travel and tourism", "cooking and recipes", "world history", "ancient civilizations", "physics",
    "chemistry", "biology", "astronomy and space", "geography", "personal finance", "economics",
    "health and fitness", "nutrition", "medicine and the human body", "psychology", "philosophy",
    "education and studying", "careers and job interviews", "parenting", "pets and animals",
    "the environment and climate", "law and everyday legal questions", "government and civics",
    "painting and visual art", "architecture", "fashion", "cars and transport", "learning languages",
    "mythology and folklore", "mathematics", "technology and gadgets", "social media", "friendship and relationships",
    "productivity and habits", "creative writing", "small business", "marketing and advertising",
    "home repair and gardening", "photography", "board games and video games", "music", "film and television",
    "literature and famous novels", "sports", "world religions and festivals", "oceans and marine life",
    "weather", "famous scientists and inventors", "cities of the world", "agriculture and food production",
    "energy and electricity", "the internet and its history", "space exploration", "dinosaurs and evolution",
    "volcanoes and earthquakes", "public speaking", "ethics", "sleep and wellbeing", "wildlife conservation",
    "national parks", "olympic games", "inventions of the twentieth century", "medieval europe",
    "the history of science", "languages and linguistics", "emergency preparedness",
)

# (style, what the seed request asks for, how a parsed line becomes a prompt)
STYLES: tuple[tuple[str, str, str], ...] = (
    ("qa", "short factual questions a curious person might ask a search engine or an assistant about {d} "
           "(one question per line, each specific, about a real fact, person, place or event)", "{line}"),
    ("writing", "requests a user might make to an AI assistant to write something about {d}: blog posts, emails, "
                "speeches, poems, stories, product descriptions or social media posts (one request per line, each "
                "with concrete details)", "{line}"),
    ("explain", "questions asking an AI assistant to explain a concept, a process or a difference related to {d} "
                "(one question per line)", "{line}"),
    ("advice", "requests for advice, a plan, a comparison or a recommendation about {d} that a user might send to "
               "an AI assistant (one request per line, each describing the user's situation in a sentence)", "{line}"),
    ("roleplay", "role-play or imaginative prompts about {d} for an AI assistant, such as 'Pretend you are ...' or "
                 "'Imagine ...' (one prompt per line)", "{line}"),
    ("math", "grade-school math word problems set in {d}, each needing two to four steps of arithmetic to solve "
             "(one problem per line, without the answer)", "{line}"),
    ("reasoning", "logic puzzles, riddles or common-sense reasoning questions about {d} (one per line, without the "
                  "answer)", "{line}"),
    ("translation", "sentences in German about {d}, of 10 to 30 words each, as they might appear in a news report "
                    "(one sentence per line, German only)", "Translate German to English: {line}"),
    ("translation-fr", "sentences in French about {d}, of 10 to 30 words each (one sentence per line, French only)",
     "Translate French to English: {line}"),
)

_NUMBERED = re.compile(r"^\s*(?:\d{1,2}[.)]|[-*•])\s+(.*\S)\s*$")


def seed_requests(seed: int = 0) -> list[tuple[str, str, str]]:
    """Every (style, domain, seed request text) in a fixed order for `seed`."""
    pairs = [(s, d) for s in range(len(STYLES)) for d in DOMAINS]
    random.Random(f"speclm-heads-requests/{seed}").shuffle(pairs)
    out = []
    for s, d in pairs:
        style, ask, _ = STYLES[s]
        text = (f"Write a numbered list of {PER_LIST} different {ask.format(d=d)}. "
                "Write only the list, with no introduction and no answers.")
        out.append((style, d, text))
    return out


def parse_list(answer: str) -> list[str]:
    """The items of a numbered or bulleted list, markdown emphasis and quotes stripped; lines that
    are too short or too long to be a request are dropped."""
    items = []
    for line in answer.splitlines():
        m = _NUMBERED.match(line)
        if not m:
            continue
        item = m.group(1).replace("**", "").strip().strip('"“”').strip()
        if 12 <= len(item) <= 400 and len(item.split()) >= 3:
            items.append(item)
    return items


def to_prompts(style: str, domain: str, answer: str) -> list[Prompt]:
    wrap = next(w for s, _, w in STYLES if s == style)
    kind = {"qa": "qa", "math": "math", "translation": "translation", "translation-fr": "translation"}.get(style, "conversation")
    return [Prompt.of(kind, f"{SOURCE}:{style}:{domain}", LICENCE, wrap.format(line=line)) for line in parse_list(answer)]


def stream(answer: Callable[[list[str]], list[str]], folder: Path, seed: int = 0, batch_size: int = 32,
           on_batch: Callable[[int], None] | None = None) -> Iterator[Prompt]:
    """Prompts from the seed requests in order, their answers read from `folder / FILE` where an
    earlier build kept them, else from answer(texts) -> the target's answers (batch_size at a time;
    each batch appended to the file before its prompts are yielded). on_batch(n): after n seed
    requests were answered."""
    path = Path(folder) / FILE
    kept: dict[str, str] = {}
    if path.is_file():
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                row = json.loads(line)
                kept[row["request"]] = row["answer"]
            except (ValueError, KeyError, TypeError):
                break  # a line cut short by an interrupted write: later ones are answered again
    seeds = seed_requests(seed)
    for i in range(0, len(seeds), batch_size):
        group = seeds[i: i + batch_size]
        missing = [text for _, _, text in group if text not in kept]
        if missing:
            answers = answer(missing)
            with path.open("a", encoding="utf-8") as f:
                for text, a in zip(missing, answers):
                    kept[text] = a
                    f.write(json.dumps({"request": text, "answer": a}, ensure_ascii=False) + "\n")
            if on_batch is not None:
                on_batch(len(missing))
        for style, domain, text in group:
            yield from to_prompts(style, domain, kept[text])
