"""Summaries, report.md, plots and run comparisons, all computed from results.json alone.

tokens/s of a method in a category is a ratio of means, as Spec-Bench computes it:
sum of new tokens / sum of seconds over that category's runs.
"""

from __future__ import annotations

import json
from pathlib import Path

from speclm.bench.costs import predicted_speedup
from speclm.files import atomic_write
from speclm.memory import gib

ALL = "all"


def _ordered(values):
    return list(dict.fromkeys(values))


def summarize(results: dict) -> dict:
    runs = results["runs"]
    methods = _ordered(r["method"] for r in runs)
    categories = _ordered(r["category"] for r in runs) + [ALL]
    table: dict[str, dict[str, dict]] = {}
    for m in methods:
        table[m] = {}
        for cat in categories:
            rs = [r for r in runs if r["method"] == m and (cat == ALL or r["category"] == cat)]
            if rs:
                table[m][cat] = _cell(rs)
    for m in methods:
        for cat, cell in table[m].items():
            for base in ("none", "hf"):
                ref = table.get(base, {}).get(cat)
                cell[f"speedup_vs_{base}"] = cell["tokens_per_second"] / ref["tokens_per_second"] if ref and ref["tokens_per_second"] else None
            ref = table.get("none", {}).get(cat, {}).get("decode_tokens_per_second")
            mine = cell.get("decode_tokens_per_second")
            cell["decode_speedup_vs_none"] = mine / ref if mine and ref else None
        per_category = [cell.get("speedup_vs_none") for cat, cell in table[m].items() if cat != ALL]
        if ALL in table[m] and per_category and None not in per_category:
            # the mean of the categories' speedups: each task kind weighs alike, however long its runs
            table[m][ALL]["mean_category_speedup_vs_none"] = sum(per_category) / len(per_category)
    return {"methods": table, "categories": categories, "predicted": _predicted(results, table)}


def _cell(rs: list[dict]) -> dict:
    tokens = sum(r["new_tokens"] for r in rs)
    seconds = sum(r["seconds"] for r in rs)
    cell = {"runs": len(rs), "new_tokens": tokens, "seconds": seconds,
            "tokens_per_second": tokens / seconds if seconds else 0.0}
    stats = [r["stats"] for r in rs if r["stats"]]
    if stats:
        forwards = sum(s["target_forwards"] for s in stats)
        drafted = sum(s["drafted_tokens"] for s in stats)
        accepted = sum(s["accepted_tokens"] for s in stats)
        width = max(len(s["accepted_per_position"]) for s in stats)
        per_pos = [sum(s["accepted_per_position"][j] for s in stats if j < len(s["accepted_per_position"])) for j in range(width)]
        wall = sum(s["wall_seconds"] for s in stats)
        cell.update(
            mean_accepted_tokens=tokens / forwards if forwards else None,
            acceptance_rate=accepted / drafted if drafted else None,
            target_forwards_per_token=forwards / tokens if tokens else None,
            accepted_per_position=per_pos,
            target_forwards=forwards,
            draft_forwards=sum(s["draft_forwards"] for s in stats),
            drafted_tokens=drafted,
            alternatives=sum(s.get("alternatives", 0) for s in stats),
            # draft tokens the target scored per forward after the prefill (a tree's nodes; chain: drafted + alternatives)
            verified_per_forward=(sum(s.get("verified_nodes", 0) for s in stats) / max(1, forwards - len(stats))),
            draft_share=sum(s["draft_seconds"] for s in stats) / wall if wall else None,
            verify_share=sum(s["verify_seconds"] for s in stats) / wall if wall else None,
            outside_forwards_share=(1 - sum(s.get("forward_seconds", 0.0) for s in stats) / wall
                                    if wall and all("forward_seconds" in s for s in stats) else None),
            decode_tokens_per_second=_decode_rate(stats),
            prefill_share=(sum(s.get("prefill_seconds", 0.0) for s in stats) / wall if wall else None),
            time=_time_parts(stats),
            rounds=forwards - len(stats),  # target forwards after each request's prefill
            # the proposers' own counters (speclm.stats.RequestStats: lookup first, lookahead's pool)
            **{name: sum(s.get(name, 0) for s in stats) for name in PROPOSER_COUNTS},
            planned=_summed([s.get("planned") or {} for s in stats]),  # auto: rounds per child
        )
    peaks = [r["peak_resident_bytes"] for r in rs if r.get("peak_resident_bytes")]
    cell["peak_resident_bytes"] = max(peaks) if peaks else None
    checked = [r["lossless"] for r in rs if r["lossless"] is not None]
    cell["lossless"] = f"{sum(checked)}/{len(checked)}" if checked else None
    return cell


PROPOSER_COUNTS = ("lookup_rounds", "pool_hits", "pool_tokens")


def _summed(counts: list[dict]) -> dict:
    out: dict = {}
    for c in counts:
        for name, n in c.items():
            out[name] = out.get(name, 0) + n
    return out


def _plan_lines(methods: dict) -> list[str]:
    """auto's plan: the share of its rounds each child drafted (none: no draft), by category."""
    rows = []
    for m, cells in methods.items():
        for category, c in cells.items():
            planned = c.get("planned") or {}
            total = sum(planned.values())
            if total:
                shares = ", ".join(f"{name} {n / total:.0%}" for name, n in sorted(planned.items(), key=lambda kv: -kv[1]))
                rows.append(f"| {m} | {category} | {total} | {shares} |")
    if not rows:
        return []
    return ["", "## What auto planned", "",
            "The share of the method's rounds (target forwards after the prefill, summed over requests) each of "
            "auto's children drafted; none: rounds the planner drafted nothing.", "",
            "| method | category | rounds | rounds by child |", "|---|---|---|---|", *rows]


def _proposer_lines(methods: dict) -> list[str]:
    """Which part of a method proposed: lookup's rounds (`+pld`), lookahead's pooled n-grams."""
    rows = []
    for m, cells in methods.items():
        c = cells.get(ALL, {})
        if any(c.get(name) for name in PROPOSER_COUNTS) and c.get("rounds"):
            hits = c["pool_hits"]
            rows.append(f"| {m} | {c['rounds']} | {c['lookup_rounds'] / c['rounds']:.0%} | {hits / c['rounds']:.0%} | "
                        f"{_fmt(c['pool_tokens'] / hits if hits else None)} |")
    if not rows:
        return []
    return ["", "## What proposed (all categories)", "",
            "Rounds: target forwards after the prefill, summed over requests. Lookup rounds: the share of them "
            "prompt lookup drafted (`+pld` methods). Pool hits: the share whose verification branch held a pooled "
            "n-gram (lookahead); accepted n-gram length: its accepted tokens per hit.", "",
            "| method | rounds | lookup rounds | pool hits | accepted n-gram length |", "|---|---|---|---|---|", *rows]


def _time_parts(stats: list[dict]) -> dict | None:
    """The requests' wall time in seconds, split: the target's prefill (the first round), the
    target's later forwards with their verification, the draft model's prefill, the rest of
    drafting, and what is left (committing tokens, bookkeeping). None for results written before
    the prefill was timed; draft_prefill None (counted in drafting) before it was."""
    if not stats or not all("prefill_seconds" in s for s in stats):
        return None
    total = {key: sum(s[key] for s in stats) for key in ("wall_seconds", "prefill_seconds", "verify_seconds", "draft_seconds")}
    split = all("draft_prefill_seconds" in s for s in stats)
    draft_prefill = sum(s["draft_prefill_seconds"] for s in stats) if split else None
    later = sum(s["target_forwards"] for s in stats) - len(stats)  # each request's forwards after its prefill
    return {"wall": total["wall_seconds"], "target_prefill": total["prefill_seconds"],
            "target_after_prefill": total["verify_seconds"] - total["prefill_seconds"],
            # seconds per such forward with its verification: a plain step's for `none`, a chain's or tree's
            # verification for the others (their ratio is the v(k) the requests met, context included)
            "per_forward": (total["verify_seconds"] - total["prefill_seconds"]) / later if later > 0 else None,
            "draft_prefill": draft_prefill, "drafting": total["draft_seconds"] - (draft_prefill or 0.0),
            "rest": total["wall_seconds"] - total["verify_seconds"] - total["draft_seconds"]}


def _decode_rate(stats: list[dict]) -> float | None:
    """Tokens after each request's first over the time after its prefill (None for results
    written before the prefill was timed)."""
    if not all("prefill_seconds" in s for s in stats):
        return None
    seconds = sum(s["wall_seconds"] - s["prefill_seconds"] for s in stats)
    tokens = sum(max(0, s["new_tokens"] - 1) for s in stats)
    return tokens / seconds if seconds > 0 else None


def _predicted(results: dict, table: dict) -> dict:
    """Predicted speedup of each drafting method from its measured tau, c and v.

    Per target forward a method spends d draft steps (draft model: its forwards; pld: one
    lookup) and verifies g tokens on average (drafted tokens and their alternatives), so the
    cost of one round, in target steps, is d·c + v(g + 1) (v interpolated between measured k)
    and the speedup is tau / that.
    """
    cost = results.get("cost_model")
    if not cost:
        return {}
    v = {int(k): x for k, x in cost["v"].items()}
    out = {}
    for label, c in cost["c"].items():
        cells = table.get(label, {})
        cell = cells.get(ALL)
        if not cell or not cell.get("target_forwards"):
            continue

        def predicted(cell):
            forwards = cell["target_forwards"]
            steps = cell["draft_forwards"] / forwards or 1.0  # a model-free proposer: one lookup a round
            gamma = (cell["drafted_tokens"] + cell.get("alternatives", 0)) / forwards
            return steps, gamma, predicted_speedup(cell["mean_accepted_tokens"], gamma, c, v, steps)

        steps, gamma, speedup = predicted(cell)
        out[label] = {"draft_steps_per_forward": steps, "drafted_per_forward": gamma, "tau": cell["mean_accepted_tokens"],
                      "c": c, "predicted_speedup": speedup, "measured_speedup": cell.get("speedup_vs_none"),
                      # the same from each category's counts alone: no timing noise beyond the cost model's
                      "by_category": {cat: predicted(x)[2] for cat, x in cells.items()
                                      if cat != ALL and x.get("target_forwards")}}
    return out


def _gib(n: int | None) -> str:
    return "–" if not n else gib(n)


def _fmt(x, spec=".2f"):
    return "–" if x is None else format(x, spec)


def _prefix_cache_line(results: dict) -> list[str]:
    """What the prefix cache spared: prompt tokens the target read from it, per speclm method."""
    size = results["config"].get("prefix_cache")
    if size is None:  # results from before speclm had one
        return []
    read: dict[str, list[int]] = {}
    for r in results["runs"]:
        if r.get("stats") and "prompt_tokens" in r:
            got = read.setdefault(r["method"], [0, 0])
            got[0] += r["stats"].get("cached_tokens", 0)
            got[1] += r["prompt_tokens"]
    if not size:
        return ["No prefix cache: every prompt is read whole.", ""]
    shares = ", ".join(f"{m} {c} of {n}" for m, (c, n) in read.items())
    return [f"Prefix cache: {size} tokens per model, each method its own (speclm.forward.prefix_cache); prompt tokens "
            f"the target took from it instead of reading them: {shares or 'none yet'}.", ""]


def markdown(results: dict, summary: dict) -> str:
    cfg, mach = results["config"], results["machine"]
    lines = ["# speclm benchmark report", ""]
    if not results.get("complete"):
        lines += [f"**Incomplete run**: interrupted after {len(results['runs'])} runs; the tables cover what finished.", ""]
    if results.get("command"):
        lines += [f"Command: `{results['command']}`", ""]
    lines += [
        f"Created {results['created']}. Target `{cfg['target']}`, draft `{cfg['draft']}`, {cfg['dtype']} activations, "
        f"weights {cfg.get('quantize', 'none') if cfg.get('quantize', 'none') != 'none' else 'as loaded (no quantization)'}"
        f"{', draft weights ' + cfg['draft_quantize'] if cfg.get('draft_quantize') else ''}, "
        f"temperature {cfg['temperature']}, {cfg['max_new_tokens']} new tokens, {cfg['repeats']} repeat(s), "
        f"dataset {cfg['dataset']}{', chat template' if cfg['chat'] else ''}.",
        "",
        *_prefix_cache_line(results),
        f"Machine: {mach['cpu']}, {mach['cpu_count']} CPUs, {mach['torch_threads']} torch threads"
        f"{', GPU ' + mach['cuda'] if mach.get('cuda') else ''}; torch {mach['torch']}, transformers {mach['transformers']}, "
        f"Python {mach['python']}"
        f"{'; int8 kernels: ' + mach['int8_kernels'] if mach.get('int8_kernels') else ''}.",
        "",
        "## Overall (all categories)",
        "",
        "| method | tokens/s | speedup vs none | speedup vs hf | decode tokens/s | decode speedup vs none | mean accepted tokens "
        "| acceptance rate | verified draft tokens / forward | target forwards / token | time outside model forwards "
        "| peak resident memory | identical to plain decoding |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    methods = summary["methods"]
    for m, cells in methods.items():
        c = cells.get(ALL)
        lines.append(
            f"| {m} | {_fmt(c['tokens_per_second'])} | {_fmt(c.get('speedup_vs_none'))} | {_fmt(c.get('speedup_vs_hf'))} | "
            f"{_fmt(c.get('decode_tokens_per_second'))} | {_fmt(c.get('decode_speedup_vs_none'))} | "
            f"{_fmt(c.get('mean_accepted_tokens'))} | {_fmt(c.get('acceptance_rate'))} | "
            f"{_fmt(c.get('verified_per_forward'))} | {_fmt(c.get('target_forwards_per_token'))} | {_fmt(c.get('outside_forwards_share'), '.2%')} | "
            f"{_gib(c.get('peak_resident_bytes'))} | {c['lossless'] or '–'} |"
        )
    lines += ["", "tokens/s is end to end (prefill included); decode tokens/s counts the tokens after the first "
              "over the time after the prefill, which is what speculation can speed up (speclm methods only).",
              "", "Time outside model forwards: share of each request's wall time spent outside target and draft "
              "forwards (drafting logic, verification, bookkeeping); it is what a faster engine loop could remove. "
              "`none` in a row's label means plain decoding on that row's weights; identical to plain decoding compares "
              "each output (greedy; sampled: speclm's, same seed) token for token with `none`'s on the same weights (a peer's with its own engine's plain "
              "decoding: `llama.cpp`, `openvino`). Verified draft tokens / forward: the draft tokens (a tree's nodes) each target forward after the prefill scored; acceptance rate is accepted over drafted, so a tree's is lower by design. Peak resident memory: the process's largest resident size during "
              "any of the method's runs (the peak is reset before each run). Every method's models and heads are loaded "
              "(its warm-up) before the first run, so this is one process holding all of them: it shows a run's own "
              "growth, not what a method needs alone (benchmarks/heads_memory.py measures that, a process per method)."]
    parts = {m: cells[ALL]["time"] for m, cells in methods.items() if cells.get(ALL, {}).get("time")}
    if parts:
        lines += ["", "## Where the time goes (all categories)", "",
                  "Seconds summed over the method's requests, and their share of its wall time.", "",
                  "| method | wall | target prefill | target forwards after it, with verification | each of them, ms "
                  "(x `none`'s) | draft's prefill (a draft model's, EAGLE's head's) | drafting (draft steps, lookup) | rest (committing tokens, "
                  "bookkeeping) |", "|---|---|---|---|---|---|---|---|"]
        step = (parts.get("none") or {}).get("per_forward")
        for m, t in parts.items():
            def cell(key):
                return "–" if t[key] is None else f"{t[key]:.1f} ({t[key] / t['wall']:.0%})" if t["wall"] else "–"
            each = t.get("per_forward")
            each = "–" if each is None else f"{each * 1e3:.1f}" + (f" ({each / step:.2f}x)" if step else "")
            lines.append(f"| {m} | {t['wall']:.1f} | {cell('target_prefill')} | {cell('target_after_prefill')} | "
                         f"{each} | {cell('draft_prefill')} | {cell('drafting')} | {cell('rest')} |")
        lines += ["", "Speculation shortens only the target's forwards after the prefill, and pays for drafting and "
                  "the draft model's prefill out of what it saves there. Each of them: the target's forward over a "
                  "round's tokens (the root and the draft tokens or tree nodes) with its verification, against "
                  "`none`'s one-token step over the same prompts: what verifying a round's draft really cost in the "
                  "requests (their contexts and the memory's speed at the time included), beside the cost model's "
                  "v(k) below, measured over a short cached prompt."]
    lines += _proposer_lines(methods)
    lines += _plan_lines(methods)
    lines += _peer_lines(results, methods)
    cats = [x for x in summary["categories"] if x != ALL]
    lines += ["", "## Speedup over `none` by category", "", "| method | " + " | ".join(cats) + " | mean of the categories |",
              "|---" * (len(cats) + 2) + "|"]
    for m, cells in methods.items():
        lines.append(f"| {m} | " + " | ".join(_fmt(cells.get(c, {}).get("speedup_vs_none")) for c in cats)
                     + f" | {_fmt(cells.get(ALL, {}).get('mean_category_speedup_vs_none'))} |")
    plain = methods.get("none", {})
    if plain.get(ALL, {}).get("prefill_share") is not None:
        lines += ["", "Share of `none`'s wall time spent in the prompt's prefill (the first round), which speculation "
                  "does not shorten: | " + " | ".join(f"{c} {_fmt(plain.get(c, {}).get('prefill_share'), '.0%')}" for c in cats)
                  + f" | all {_fmt(plain[ALL]['prefill_share'], '.0%')} |"]
    lines += ["", "## tokens/s by category", "", "| method | " + " | ".join(cats) + " |", "|---" * (len(cats) + 1) + "|"]
    for m, cells in methods.items():
        lines.append(f"| {m} | " + " | ".join(_fmt(cells.get(c, {}).get("tokens_per_second")) for c in cats) + " |")
    lines += ["", "## Mean accepted tokens per target forward by category", "", "| method | " + " | ".join(cats) + " |",
              "|---" * (len(cats) + 1) + "|"]
    for m, cells in methods.items():
        if cells.get(ALL, {}).get("mean_accepted_tokens") is not None:
            lines.append(f"| {m} | " + " | ".join(_fmt(cells.get(c, {}).get("mean_accepted_tokens")) for c in cats) + " |")
    lines += ["", "## Acceptance rate by category", "", "Accepted over drafted tokens (a tree's nodes count as drafted).",
              "", "| method | " + " | ".join(cats) + " |", "|---" * (len(cats) + 1) + "|"]
    for m, cells in methods.items():
        if cells.get(ALL, {}).get("acceptance_rate") is not None:
            lines.append(f"| {m} | " + " | ".join(_fmt(cells.get(c, {}).get("acceptance_rate")) for c in cats) + " |")
    cost = results.get("cost_model")
    if cost:
        v = cost["v"]
        lines += ["", "## Cost model (measured in this run)", "",
                  f"One target forward over 1 new token: {cost['target_step_seconds'] * 1000:.1f} ms"
                  + (f"; one draft step (first draft method): {cost['draft_step_seconds'] * 1000:.1f} ms." if cost.get("draft_step_seconds") else "."),
                  "", "| k | " + " | ".join(str(k) for k in v) + " |", "|---" * (len(v) + 1) + "|",
                  "| v(k) | " + " | ".join(_fmt(x) for x in v.values()) + " |", ""]
        if summary["predicted"]:
            lines += ["| method | draft steps d / forward | verified draft tokens g / forward (alternatives included) | tau | c | predicted speedup | measured speedup |",
                      "|---|---|---|---|---|---|---|"]
            for label, p in summary["predicted"].items():
                lines.append(f"| {label} | {_fmt(p['draft_steps_per_forward'])} | {_fmt(p['drafted_per_forward'])} | {_fmt(p['tau'])} | "
                             f"{_fmt(p['c'], '.3f')} | {_fmt(p['predicted_speedup'])} | {_fmt(p['measured_speedup'])} |")
            lines += ["", "predicted = tau / (d·c + v(g+1)), the textbook tau / (gamma·c + v(gamma+1)) with gamma measured "
                      "per forward, from forwards over a short cached prompt. It leaves out the draft model's own prefill of "
                      "each prompt, attention over longer contexts and the engine's work between forwards "
                      "(the overhead column): a measured speedup well below it is one of those."]
            lines += ["", "Predicted speedup by category: the same formula on each category's token counts, which do "
                      "not depend on the machine's timing (greedy), with this run's c and v; it compares methods "
                      "without the run-to-run noise of wall time.", "",
                      "| method | " + " | ".join(cats) + " |", "|---" * (len(cats) + 1) + "|"]
            for label, p in summary["predicted"].items():
                lines.append(f"| {label} | " + " | ".join(_fmt(p["by_category"].get(c)) for c in cats) + " |")
    bad = [r for r in results["runs"] if r["lossless"] is False]
    lines += ["", "## Lossless check", ""]
    if bad:
        lines += [f"**{len(bad)} output(s) differ from their plain decoding's:**", "",
                  "| method | prompt | first differing position | expected | got | target top-2 logit margin there |", "|---|---|---|---|---|---|"]
        for r in bad:
            mm = r["mismatch"]
            margin = "–" if mm.get("top2_margin") is None else f"{mm['top2_margin']:.4g}"
            lines.append(f"| {r['method']} | {r['category']}/{r['prompt_id']} | {mm['position']} | {mm['expected']} | {mm['got']} | {margin} |")
        lines += ["", "A margin near 0 is a floating-point near-tie (a k-token forward is not bit-identical to k 1-token forwards); "
                  "a large one is a bug. A peer's margin is not shown: speclm's target is not that engine's model."]
    elif cfg["temperature"] == 0:
        lines.append("Every greedy output equals its plain decoding's token for token.")
    else:
        lines.append("Every speclm method's sampled output equals its plain decoding's with the same seed, token for "
                     "token (each token drawn by its position: docs/methods.md#sampling); peers' and transformers' "
                     "samples are not compared.")
    shown = ["speedup.png", "accepted_per_position.png"] + (["v_k.png"] if results.get("cost_model") else [])  # plots()'s
    lines += ["", "Plots: " + ", ".join(f"`{name}`" for name in shown) + ".", ""]
    return "\n".join(lines)


def _peer_lines(results: dict, methods: dict) -> list[str]:
    """What the other engines ran, at which settings: transformers' assisted generation and the peers."""
    rows = []
    for label in methods:
        name = label.partition(":")[0]
        if name == "hf-assisted":
            rows.append(f"- `{label}`: transformers' assisted generation, " + (
                "a fixed number of draft tokens each round (constant schedule, no confidence stop)" if ":" in label and "k=" in label
                else "transformers' default schedule: up to 20 draft tokens a round, stopped where the draft's confidence "
                     "falls below a threshold (0.4 at first) that transformers adjusts as rounds are accepted or rejected"))
        elif name in ("hf", "hf-pld"):
            rows.append(f"- `{label}`: transformers' `generate`" + (" with prompt lookup" if name == "hf-pld" else "")
                        + ", on the same model objects as speclm's methods")
        elif label in results.get("peers", {}):
            rows.append(f"- `{label}`: {results['peers'][label]}")
    if not rows:
        return []
    return ["", "## Other engines and their settings", "", *rows, "",
            "Every engine reads the same prompt token ids and runs with this run's thread count."]


def plots(results: dict, summary: dict, out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    methods = {m: c for m, c in summary["methods"].items() if m != "none"}
    cats = summary["categories"]
    fig, ax = plt.subplots(figsize=(max(6, 1.3 * len(cats)), 4))
    width = 0.8 / max(1, len(methods))
    for i, (m, cells) in enumerate(methods.items()):
        xs = [j + i * width for j in range(len(cats))]
        ax.bar(xs, [cells.get(c, {}).get("speedup_vs_none") or 0 for c in cats], width, label=m)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks([j + width * (len(methods) - 1) / 2 for j in range(len(cats))], cats, rotation=20)
    ax.set_ylabel("speedup over none (tokens/s ratio)")
    ax.set_title(f"{results['config']['target']}: speedup by category")
    ax.legend(fontsize=8)
    fig.tight_layout()
    written.append(_save(fig, out_dir / "speedup.png"))

    fig, ax = plt.subplots(figsize=(6, 4))
    for m, cells in summary["methods"].items():
        c = cells.get(ALL, {})
        if c.get("accepted_per_position") and c.get("target_forwards"):
            ax.plot(range(1, len(c["accepted_per_position"]) + 1),
                    [x / c["target_forwards"] for x in c["accepted_per_position"]], marker="o", label=m)
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.set_xlabel("draft position (a tree's depth)")
    ax.set_ylabel("share of target forwards accepting a token there")
    ax.set_ylim(0, 1)
    ax.set_title("accepted tokens by draft position or tree depth")
    if ax.get_legend_handles_labels()[0]:  # no line where no method drafted
        ax.legend(fontsize=8)
    fig.tight_layout()
    written.append(_save(fig, out_dir / "accepted_per_position.png"))

    cost = results.get("cost_model")
    if cost:
        ks = [int(k) for k in cost["v"]]
        fig, ax = plt.subplots(figsize=(6, 4))
        ax.plot(ks, list(cost["v"].values()), marker="o", label="measured v(k)")
        ax.plot(ks, ks, linestyle="--", color="gray", label="v(k) = k (no batching gain)")
        ax.set_xlabel("new tokens in one target forward (k)")
        ax.set_ylabel("cost / cost of 1 token")
        ax.set_title(f"verification cost v(k), {results['config']['dtype']}")
        ax.legend(fontsize=8)
        fig.tight_layout()
        written.append(_save(fig, out_dir / "v_k.png"))
    return written


def _save(fig, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_all(results: dict, out_dir: Path) -> None:
    """results.json, report.md and plots; each file is replaced whole (write, then rename)."""
    summary = summarize(results) if results["runs"] else {"methods": {}, "categories": [], "predicted": {}}
    results["summary"] = summary
    atomic_write(out_dir / "results.json", json.dumps(results, indent=1))
    if results["runs"]:
        atomic_write(out_dir / "report.md", markdown(results, summary))
        plots(results, summary, out_dir)


def compare(a: dict, b: dict, name_a: str = "A", name_b: str = "B") -> str:
    sa, sb = summarize(a), summarize(b)
    lines = [f"| method | category | {name_a} tokens/s | {name_b} tokens/s | {name_b}/{name_a} | "
             f"{name_a} speedup vs none | {name_b} speedup vs none | {name_a} mean accepted | {name_b} mean accepted |",
             "|---|---|---|---|---|---|---|---|---|"]
    for m in _ordered(list(sa["methods"]) + list(sb["methods"])):
        for cat in _ordered(sa["categories"] + sb["categories"]):
            ca, cb = sa["methods"].get(m, {}).get(cat), sb["methods"].get(m, {}).get(cat)
            if not ca and not cb:
                continue
            ta, tb = (ca or {}).get("tokens_per_second"), (cb or {}).get("tokens_per_second")
            lines.append(
                f"| {m} | {cat} | {_fmt(ta)} | {_fmt(tb)} | {_fmt(tb / ta if ta and tb else None)} | "
                f"{_fmt((ca or {}).get('speedup_vs_none'))} | {_fmt((cb or {}).get('speedup_vs_none'))} | "
                f"{_fmt((ca or {}).get('mean_accepted_tokens'))} | {_fmt((cb or {}).get('mean_accepted_tokens'))} |"
            )
    return "\n".join(lines)
