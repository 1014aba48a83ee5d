"""Constrained decoding (speclm.constraint): how fast JSON-schema-constrained requests run with
speculation, and what the constraint costs.

1. Libraries: the token-mask time of llguidance (speclm's), xgrammar and outlines-core, those
   installed, on the target's tokenizer: each SCHEMAS' compile time, and its mask time per token
   along a valid output (the schema's example, json.dumps'd and tokenized), median of 3.
2. Speed: the 12 TASKS (each a prompt and its own schema; none from Spec-Bench), chat, greedy,
   with `none`, `draft+pld` and `auto` (methods interleaved per prompt): total tokens / total time
   of each, x none, outputs identical to none's, outputs that parse and validate, and the
   constraint's share of each method's time (masks along every draft).

Run: .venv/bin/python benchmarks/constrained.py > constrained.txt
Committed output: benchmarks/amx/records.md#constrained (Intel Xeon AMX machine).
`--smoke --target FOLDER --draft FOLDER`: the same code path on tiny models, 2 tasks, 6 tokens.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import jsonschema

from speclm.files import cpu_name
from speclm.engine import SpecEngine
from speclm.models.loading import load_model
from speclm.runtime import set_threads, usable_cores, weights_for
from speclm.text import byte_level_table


def _obj(props: dict, example: dict) -> tuple[dict, dict]:
    schema = {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}
    return schema, example


S = {"type": "string"}
I = {"type": "integer"}  # noqa: E741
B = {"type": "boolean"}
TASKS = [
    ("Extract the person as JSON (name, age, city): Maria Oliveira, 34, has lived in Lisbon since 2015.",
     _obj({"name": S, "age": I, "city": S}, {"name": "Maria Oliveira", "age": 34, "city": "Lisbon"})),
    ("Give the function's signature as JSON (name, arguments, returns): def parse_date(text: str, fmt: str) -> datetime",
     _obj({"name": S, "arguments": {"type": "array", "items": S}, "returns": S},
          {"name": "parse_date", "arguments": ["text", "fmt"], "returns": "datetime"})),
    ("Classify the review's sentiment as JSON (sentiment: positive, negative or neutral; reason): "
     "The battery lasts two days, but the screen scratches far too easily.",
     _obj({"sentiment": {"enum": ["positive", "negative", "neutral"]}, "reason": S},
          {"sentiment": "neutral", "reason": "good battery, fragile screen"})),
    ("List the ingredients as JSON (items with name and grams): 200 g flour, 100 g sugar, 50 g butter, 2 g salt.",
     _obj({"items": {"type": "array", "items": _obj({"name": S, "grams": I}, {})[0]}},
          {"items": [{"name": "flour", "grams": 200}, {"name": "sugar", "grams": 100}]})),
    ("Turn the log line into JSON (level, service, message, code): "
     "2026-03-02 14:22:01 ERROR payments: card declined by issuer (code 402)",
     _obj({"level": S, "service": S, "message": S, "code": I},
          {"level": "ERROR", "service": "payments", "message": "card declined by issuer", "code": 402})),
    ("Describe the SQL table as JSON (table, columns with name and type): "
     "CREATE TABLE orders (id INTEGER PRIMARY KEY, customer TEXT, total REAL, paid BOOLEAN);",
     _obj({"table": S, "columns": {"type": "array", "items": _obj({"name": S, "type": S}, {})[0]}},
          {"table": "orders", "columns": [{"name": "id", "type": "INTEGER"}]})),
    ("Extract the meeting as JSON (title, day, time, attendees): Design review on Thursday at 15:30 with Ana, "
     "Ben and Chloe.",
     _obj({"title": S, "day": S, "time": S, "attendees": {"type": "array", "items": S}},
          {"title": "Design review", "day": "Thursday", "time": "15:30", "attendees": ["Ana", "Ben", "Chloe"]})),
    ("Answer as JSON (answer, explanation): Is 221 a prime number?",
     _obj({"answer": B, "explanation": S}, {"answer": False, "explanation": "221 = 13 * 17"})),
    ("Give the book as JSON (title, author, year, genres): Frank Herbert's Dune, published in 1965, is science "
     "fiction and adventure.",
     _obj({"title": S, "author": S, "year": I, "genres": {"type": "array", "items": S}},
          {"title": "Dune", "author": "Frank Herbert", "year": 1965, "genres": ["science fiction", "adventure"]})),
    ("Convert the address to JSON (street, number, postcode, city, country): Hauptstrasse 12, 10115 Berlin, Germany",
     _obj({"street": S, "number": S, "postcode": S, "city": S, "country": S},
          {"street": "Hauptstrasse", "number": "12", "postcode": "10115", "city": "Berlin", "country": "Germany"})),
    ("Give the HTTP request as JSON (method, path, headers as name/value pairs): "
     "GET /api/v2/users?page=3 with Accept: application/json and Authorization: Bearer abc123",
     _obj({"method": S, "path": S, "headers": {"type": "array", "items": _obj({"name": S, "value": S}, {})[0]}},
          {"method": "GET", "path": "/api/v2/users?page=3", "headers": [{"name": "Accept", "value": "application/json"}]})),
    ("Summarise the bug report as JSON (component, severity: low, medium or high, steps): The export button in "
     "the reports page crashes the app when the date range is empty; open reports, clear the dates, press export.",
     _obj({"component": S, "severity": {"enum": ["low", "medium", "high"]}, "steps": {"type": "array", "items": S}},
          {"component": "reports", "severity": "high", "steps": ["open reports", "clear the dates", "press export"]})),
]


def _all(results) -> None:
    """A walk's consume results: every token of the valid output taken (else the timing is not of it)."""
    if not all(r is not False for r in results):
        raise RuntimeError("a library refused the schema's example output")


def _median_ms(fn, repeats: int = 3) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(1000 * (time.perf_counter() - t0))
    return statistics.median(times)


def libraries(tokenizer, vocab: int, tasks) -> None:
    """Part 1: per library, compile ms and mask us per token, mean over the tasks' schemas."""
    import numpy as np
    import torch

    paths = [tokenizer(json.dumps(example)).input_ids for _, (_, example) in tasks]
    rows = []
    try:
        import llguidance
        import llguidance.hf
        import llguidance.torch as lt

        from speclm.constraint import JSON_OPTIONS

        lltok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=max(vocab, len(tokenizer)))

        def llg(schema, path):
            grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, JSON_OPTIONS)
            m = llguidance.LLMatcher(lltok, grammar)
            mask = lt.allocate_token_bitmask(1, lltok.vocab_size)
            return m, lambda: _all([lt.fill_next_token_bitmask(m, mask, 0) or m.consume_token(t) for t in path])

        rows.append(("llguidance", llg))
    except ImportError:
        print("llguidance: not installed")
    try:
        import xgrammar as xg

        info = xg.TokenizerInfo.from_huggingface(tokenizer, vocab_size=max(vocab, len(tokenizer)))
        compiler = xg.GrammarCompiler(info, max_threads=1, cache_enabled=False)

        def xgr(schema, path):
            m = xg.GrammarMatcher(compiler.compile_json_schema(json.dumps(schema)))
            mask = xg.allocate_token_bitmask(1, info.vocab_size)
            return m, lambda: _all([m.fill_next_token_bitmask(mask, 0) or m.accept_token(t) for t in path])

        rows.append(("xgrammar", xgr))
    except ImportError:
        print("xgrammar: not installed")
    try:
        import outlines_core as oc

        back = byte_level_table()
        words: dict = {}
        for token, i in tokenizer.get_vocab().items():
            if i != tokenizer.eos_token_id and i < vocab:
                words.setdefault(bytes(back.get(c, 0) for c in token) if all(c in back for c in token) else token, []).append(i)
        ocvocab = oc.Vocabulary(tokenizer.eos_token_id, words)

        def outl(schema, path):
            index = oc.Index(oc.json_schema.build_regex_from_schema(json.dumps(schema), r"[ \n\t\r]{0,16}"), ocvocab)
            g = oc.Guide(index)
            mask = torch.zeros((vocab + 31) // 32, dtype=torch.int32)
            return g, lambda: [g.write_mask_into(mask.data_ptr(), mask.numel(), 4) or g.advance(t) for t in path]  # raises if refused

        rows.append(("outlines-core", outl))
    except ImportError:
        print("outlines-core: not installed")
    print("| library | compile ms (mean of schemas) | mask us / token (mean) | tokens walked |")
    print("|---|---|---|---|")
    for name, make in rows:
        compile_ms, mask_us, walked = [], [], 0
        for (_, (schema, _)), path in zip(tasks, paths):
            compile_ms.append(_median_ms(lambda: make(schema, path)))
            per = []
            for _ in range(3):
                _, walk = make(schema, path)
                t0 = time.perf_counter()
                walk()
                per.append(1e6 * (time.perf_counter() - t0) / len(path))
            mask_us.append(statistics.median(per))
            walked += len(path)
        print(f"| {name} | {np.mean(compile_ms):.1f} | {np.mean(mask_us):.0f} | {walked} |")


def speed(engine: SpecEngine, tasks, methods: list[str], new_tokens: int) -> None:
    """Part 2: the tasks with each method, interleaved per task."""
    fmt = lambda schema: {"type": "json_schema", "json_schema": {"name": "out", "schema": schema}}  # noqa: E731
    engine.generate(tasks[0][0], method=methods[-1], max_new_tokens=4, chat=True, response_format=fmt(tasks[0][1][0]))
    totals = {m: [0, 0.0, 0.0, 0, 0] for m in methods}  # tokens, seconds, constraint seconds, identical, valid
    for prompt, (schema, _) in tasks:
        plain = None
        for m in methods:
            t0 = time.perf_counter()
            out = engine.generate(prompt, method=m, max_new_tokens=new_tokens, chat=True, response_format=fmt(schema))
            wall = time.perf_counter() - t0
            plain = out.token_ids if plain is None else plain
            t = totals[m]
            t[0] += len(out.token_ids)
            t[1] += wall
            t[2] += out.stats.constraint_seconds
            t[3] += out.token_ids == plain
            try:
                jsonschema.validate(json.loads(out.text), schema)
                t[4] += 1
            except (ValueError, jsonschema.ValidationError):
                pass
    rate = totals[methods[0]][0] / totals[methods[0]][1]
    print("| method | tokens | seconds | tokens/s | x none | identical to none | parse and validate | constraint's share |")
    print("|---|---|---|---|---|---|---|---|")
    for m, (tokens, seconds, masks, same, ok) in totals.items():
        print(f"| {m} | {tokens} | {seconds:.1f} | {tokens / seconds:.2f} | {tokens / seconds / rate:.3f} | "
              f"{same}/{len(tasks)} | {ok}/{len(tasks)} | {100 * masks / seconds:.1f}% |")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="qwen2.5-coder-1.5b", help="catalog name or model folder")
    parser.add_argument("--draft", default="qwen2.5-coder-0.5b", help="catalog name or model folder")
    parser.add_argument("--methods", default="none,draft+pld,auto", help="comma list; none first")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--part", choices=("all", "libraries", "speed"), default="all")
    parser.add_argument("--smoke", action="store_true", help="tiny run: 2 tasks, 6 tokens, 1 thread")
    args = parser.parse_args()
    methods = [m.strip() for m in args.methods.split(",")]
    if methods[0] != "none":
        parser.error("--methods must start with none (the reference)")
    tasks = TASKS[:2] if args.smoke else TASKS
    new_tokens = 6 if args.smoke else args.max_new_tokens
    set_threads(1 if args.smoke else usable_cores())
    quantize, draft_quantize = weights_for("auto")
    target = load_model(args.target, quantize=quantize, progress=False)
    print(f"# machine: {cpu_name()}; {len(tasks)} tasks, {new_tokens} new tokens, chat, greedy; "
          f"target {quantize}, draft {draft_quantize}")
    if args.part in ("all", "libraries"):
        print("\n## Libraries\n")
        libraries(target.tokenizer, target.vocab_size, tasks)
    if args.part in ("all", "speed"):
        print("\n## Speed\n")
        draft = load_model(args.draft, quantize=draft_quantize, progress=False)
        speed(SpecEngine(target, draft=draft), tasks, methods, new_tokens)


if __name__ == "__main__":
    main()
