"""The benchmark harness on tiny models: arithmetic, lossless check, files, interruption."""

import json

import pytest

from speclm.bench import report
from speclm.bench.costs import predicted_speedup
from speclm.bench.dataset import SPEC_BENCH_KINDS, load_prompts
from speclm.bench.methods import RunResult, parse_methods
from speclm.bench.runner import BenchConfig, run_bench
from speclm.cli import main
from speclm.errors import UsageError
from tiny import require_compiled_kernels


def config(**kw):
    base = dict(target="tiny", draft="tiny-draft", methods=[], dataset="spec-bench", categories=None, per_category=1,
                max_new_tokens=12, temperature=0.0, seed=0, repeats=1, chat=False, cost_repeats=1)
    base.update(kw)
    return BenchConfig(**base)


def test_parse_methods():
    assert parse_methods("draft:vocab=32768")[0].decoding_options == {"draft_vocab": 32768}
    both = parse_methods("draft+pld:prompt_ratio=0,ngram_min=3")[0]
    assert both.needs_draft and both.decoding_options == {"draft_prompt_ratio": 0.0, "ngram_min": 3}
    specs = parse_methods("none,draft:k=4,pld:k=8,ngram_max=2,hf,hf-assisted:k=3,hf-pld")
    assert [s.label for s in specs] == ["none", "draft:k=4", "pld:k=8,ngram_max=2", "hf", "hf-assisted:k=3", "hf-pld"]
    assert specs[2].options == {"k": 8, "ngram_max": 2}
    for bad in ("beam", "draft:k=0", "draft:depth=2", "pld:k=x", "none,none"):
        with pytest.raises(UsageError):
            parse_methods(bad)


def test_spec_bench_has_six_kinds_and_selection():
    prompts = load_prompts("spec-bench", None, 2)
    assert sorted({p.category for p in prompts}) == sorted(SPEC_BENCH_KINDS)
    assert len(prompts) == 12
    mt = load_prompts("spec-bench", ["mt_bench"], 4)
    assert [p.prompt_id for p in mt] == ["81", "101", "121", "141"]  # spread over MT-bench sub-categories
    with pytest.raises(UsageError):
        load_prompts("spec-bench", ["poetry"], 1)


def fake_run(method, category, tokens, seconds, forwards=None, drafted=0, accepted=0, lossless=None):
    stats = None
    if forwards is not None:
        stats = {"target_forwards": forwards, "draft_forwards": drafted, "drafted_tokens": drafted,
                 "accepted_tokens": accepted, "accepted_per_position": [accepted], "draft_seconds": 0.1,
                 "verify_seconds": seconds - 0.1, "wall_seconds": seconds}
    return {"prompt_id": "1", "category": category, "method": method, "repeat": 0, "new_tokens": tokens,
            "seconds": seconds, "tokens_per_second": tokens / seconds, "token_ids": [], "stats": stats,
            "lossless": lossless, "mismatch": None}


def test_summary_arithmetic():
    runs = [
        fake_run("none", "a", 100, 10.0, forwards=100),
        fake_run("none", "b", 50, 10.0, forwards=50),
        fake_run("pld", "a", 100, 5.0, forwards=40, drafted=80, accepted=60, lossless=True),
        fake_run("pld", "b", 50, 10.0, forwards=50, drafted=10, accepted=0, lossless=False),
        # the hf baseline's totals differ from none's (150 tokens in 12 s, not 20 s), so a speedup
        # computed against the wrong baseline shows
        fake_run("hf", "a", 100, 8.0),
        fake_run("hf", "b", 50, 4.0),
    ]
    s = report.summarize({"runs": runs, "cost_model": None})
    none_all = s["methods"]["none"]["all"]
    assert none_all["tokens_per_second"] == pytest.approx(150 / 20)  # ratio of means, not mean of ratios
    pld = s["methods"]["pld"]
    assert pld["a"]["speedup_vs_none"] == pytest.approx(20 / 10)
    assert pld["all"]["speedup_vs_none"] == pytest.approx((150 / 15) / (150 / 20))
    # against hf: pld's 10 tokens/s over hf's 150 / 12 = 12.5; per category (100/5) / (100/8) and
    # (50/10) / (50/4); none's 7.5 over 12.5
    assert pld["all"]["speedup_vs_hf"] == pytest.approx(0.8)
    assert pld["a"]["speedup_vs_hf"] == pytest.approx(1.6)
    assert pld["b"]["speedup_vs_hf"] == pytest.approx(0.4)
    assert none_all["speedup_vs_hf"] == pytest.approx(0.6)
    hf_all = s["methods"]["hf"]["all"]
    assert hf_all["tokens_per_second"] == pytest.approx(12.5)
    assert hf_all["speedup_vs_none"] == pytest.approx(12.5 / 7.5) and hf_all["speedup_vs_hf"] == pytest.approx(1.0)
    assert pld["all"]["mean_accepted_tokens"] == pytest.approx(150 / 90)
    assert pld["all"]["acceptance_rate"] == pytest.approx(60 / 90)
    assert pld["all"]["target_forwards_per_token"] == pytest.approx(90 / 150)
    assert pld["all"]["lossless"] == "1/2"
    # each category weighs alike in the mean of the categories' speedups: (2.0 + 1.0) / 2
    assert pld["all"]["mean_category_speedup_vs_none"] == pytest.approx((20 / 10 + 5 / 5) / 2)
    assert pld["all"]["mean_category_speedup_vs_none"] != pytest.approx(pld["all"]["speedup_vs_none"])
    assert "mean_accepted_tokens" not in s["methods"]["hf"]["a"]  # transformers reports no acceptance


def test_predicted_speedup_formula():
    v = {1: 1.0, 2: 1.2, 3: 1.5, 4: 2.0, 5: 2.2}
    assert predicted_speedup(3.0, 4, 0.25, v) == pytest.approx(3.0 / (4 * 0.25 + 2.2))
    assert predicted_speedup(1.5, 1.5, 0.0, v, draft_steps=1) == pytest.approx(1.5 / 1.35)
    assert predicted_speedup(2.0, 9, 0.1, v) is None  # v(10) not measured


def test_run_writes_results_report_and_plots(engine, tmp_path, dataset):
    specs = parse_methods("none,draft:k=2,draft:k=3,alternatives=1,pld:k=3,draft+pld:k=2,lookahead+pld:w=2,n=3,g=2,"
                          "hf,hf-assisted:k=2,hf-pld:k=3")
    prompts = load_prompts(dataset, ["qa", "rag"], 1)
    out = tmp_path / "out"
    results = run_bench(engine, specs, prompts, config(methods=[s.label for s in specs]), out, progress=False)
    assert results["complete"]
    saved = json.loads((out / "results.json").read_text())
    assert len(saved["runs"]) == 2 * len(specs)
    first, second = ([r["method"] for r in saved["runs"] if r["prompt_id"] == p.prompt_id] for p in prompts)
    assert first[0] == second[0] == "none"  # plain decoding first: the reference; the others' order turned by one
    others = [m for m in first if m != "none" and m in second[1:]]
    assert [m for m in second if m in others] == others[1:] + others[:1], (first, second)
    assert set(saved["cost_model"]["v"]) == {str(k) for k in range(1, 17)}
    assert all(r["lossless"] for r in saved["runs"] if r["method"] != "none")
    text = (out / "report.md").read_text()
    assert "| draft:k=2 |" in text and "Every greedy output equals" in text and "predicted speedup" in text
    # per category, the formula on that category's counts alone
    predicted = saved["summary"]["predicted"]["draft:k=2"]
    assert set(predicted["by_category"]) == {"qa", "rag"}
    cell, cost = saved["summary"]["methods"]["draft:k=2"]["qa"], saved["cost_model"]
    forwards = cell["target_forwards"]
    assert predicted["by_category"]["qa"] == pytest.approx(predicted_speedup(
        cell["mean_accepted_tokens"], cell["drafted_tokens"] / forwards, cost["c"]["draft:k=2"],
        {int(k): x for k, x in cost["v"].items()}, cell["draft_forwards"] / forwards))
    # alternatives widen the verification: they count in g beside the drafted tokens
    with_alt = saved["summary"]["methods"]["draft:k=3,alternatives=1"][report.ALL]
    assert with_alt["alternatives"] > 0
    p = saved["summary"]["predicted"]["draft:k=3,alternatives=1"]
    assert p["drafted_per_forward"] == pytest.approx(
        (with_alt["drafted_tokens"] + with_alt["alternatives"]) / with_alt["target_forwards"])
    assert "Predicted speedup by category" in text
    # the proposers' own counters: lookup's rounds and lookahead's pool, summed over the requests
    la = saved["summary"]["methods"]["lookahead+pld:w=2,n=3,g=2"][report.ALL]
    runs = [r["stats"] for r in saved["runs"] if r["method"] == "lookahead+pld:w=2,n=3,g=2"]
    assert la["pool_hits"] == sum(r["pool_hits"] for r in runs) and la["rounds"] > 0
    assert la["lookup_rounds"] + la["pool_hits"] > 0
    assert "## What proposed" in text and "| lookahead+pld:w=2,n=3,g=2 |" in text.split("## What proposed")[1]
    for png in ("speedup.png", "accepted_per_position.png", "v_k.png"):
        assert (out / png).read_bytes()[:4] == b"\x89PNG"


def _plant_mismatch(monkeypatch, method: str, position: int) -> None:
    """`method`'s outputs (past the warm-up) get a wrong token at `position`."""
    import speclm.bench.runner as runner

    real = runner.run_method

    def corrupt(spec, eng, ids, n, temperature, seed, peer=None):
        r = real(spec, eng, ids, n, temperature, seed)
        if spec.name == method and n > 8:
            wrong = (r.token_ids[position] + 1) % 257
            r = RunResult(r.token_ids[:position] + [wrong] + r.token_ids[position + 1:], r.seconds, r.stats)
        return r

    monkeypatch.setattr(runner, "run_method", corrupt)


def test_lossless_check_catches_planted_mismatch(engine, tmp_path, monkeypatch, dataset):
    _plant_mismatch(monkeypatch, "pld", 5)
    specs = parse_methods("none,pld")
    results = run_bench(engine, specs, load_prompts(dataset, ["qa"], 1), config(), tmp_path / "out", progress=False,
                        measure_cost_model=False)
    bad = [r for r in results["runs"] if r["lossless"] is False]
    assert len(bad) == 1 and bad[0]["mismatch"]["position"] == 5
    assert bad[0]["mismatch"]["top2_margin"] > 0
    assert "1 output(s) differ from their plain decoding" in (tmp_path / "out" / "report.md").read_text()


def test_sampled_outputs_are_checked_against_plain_decodings_with_the_same_seed(engine, tmp_path, monkeypatch, dataset):
    """At temperature 1 every speclm method's output is its plain decoding's with the same seed
    (speclm.sampling.Coupled), so the bench checks it; a changed token is reported, without a margin."""
    specs = parse_methods("none,pld,draft+pld,draft")
    results = run_bench(engine, specs, load_prompts(dataset, ["qa", "rag"], 1), config(temperature=1.0, repeats=2),
                        tmp_path / "out", progress=False, measure_cost_model=False)
    checked = [r["lossless"] for r in results["runs"] if r["method"] != "none"]
    assert len(checked) == 12 and all(checked)
    assert "sampled output equals its plain decoding's" in (tmp_path / "out" / "report.md").read_text()
    _plant_mismatch(monkeypatch, "draft", 3)
    results = run_bench(engine, parse_methods("none,draft"), load_prompts(dataset, ["qa"], 1), config(temperature=1.0),
                        tmp_path / "out2", progress=False, measure_cost_model=False)
    bad = [r for r in results["runs"] if r["lossless"] is False]
    assert len(bad) == 1 and bad[0]["mismatch"] == {"position": 3, "expected": bad[0]["mismatch"]["expected"],
                                                     "got": bad[0]["token_ids"][3], "top2_margin": None}


def test_interrupted_run_keeps_finished_part(engine, tmp_path, monkeypatch, dataset):
    import speclm.bench.runner as runner

    real, calls = runner.run_method, []

    def interrupt_later(spec, eng, ids, n, temperature, seed, peer=None):
        calls.append(spec.label)
        if len(calls) == 2 + 5:  # 2 warm-ups, 2 prompts of 2 methods, then stop inside the third prompt
            raise KeyboardInterrupt
        return real(spec, eng, ids, n, temperature, seed)

    monkeypatch.setattr(runner, "run_method", interrupt_later)
    specs = parse_methods("none,pld")
    out = tmp_path / "out"
    results = run_bench(engine, specs, load_prompts(dataset, ["qa", "rag", "translation"], 1), config(),
                        out, progress=False, measure_cost_model=False)
    saved = json.loads((out / "results.json").read_text())
    assert results["complete"] is False and saved["complete"] is False
    assert len(saved["runs"]) == 4
    assert "Incomplete run" in (out / "report.md").read_text()


def test_compare_table(tmp_path):
    runs_a = [fake_run("none", "a", 100, 10.0, forwards=100), fake_run("pld", "a", 100, 5.0, forwards=50, drafted=60, accepted=50)]
    runs_b = [fake_run("none", "a", 100, 5.0, forwards=100), fake_run("pld", "a", 100, 2.0, forwards=40, drafted=60, accepted=60)]
    for name, runs in (("A", runs_a), ("B", runs_b)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "results.json").write_text(json.dumps({"runs": runs, "cost_model": None}))
    table = report.compare({"runs": runs_a}, {"runs": runs_b})
    assert "| pld | all | 20.00 | 50.00 | 2.50 | 2.00 | 2.50 | 2.00 | 2.50 |" in table
    assert main(["bench", "--compare", str(tmp_path / "A" / "results.json"), str(tmp_path / "B" / "results.json")]) == 0


def test_bench_cli_errors(capsys):
    assert main(["bench", "--target", "x", "--methods", "none,draft", "--out", "o"]) == 2
    assert "need --draft" in capsys.readouterr().err
    assert main(["bench", "--methods", "none"]) == 2
    assert main(["bench", "--compare", "nope.json", "nope2.json"]) == 2


def test_bench_int8_beside_fp32_in_one_run(folders, tmp_path, dataset, capsys):
    """`none:quantize=none` runs on fp32 weights beside int8 methods; lossless is per weights."""
    target, draft = folders["target"], folders["draft"]
    out = tmp_path / "mixed"
    code = main(["bench", "--target", target, "--draft", draft, "--quantize", "int8",
                 "--methods", "none,none:quantize=none,draft:k=3,pld:k=4,draft:tree=auto,hf", "--dataset", dataset,
                 "--categories", "qa", "--per-category", "1", "--max-new-tokens", "10", "--cost-repeats", "1",
                 "--out", str(out)])
    assert code == 0
    saved = json.loads((out / "results.json").read_text())
    assert saved["config"]["quantize"] == "int8"
    runs = {r["method"]: r for r in saved["runs"]}
    assert runs["draft:k=3"]["lossless"] and runs["pld:k=4"]["lossless"]  # vs int8 none
    assert runs["draft:tree=auto"]["lossless"]  # a tree method beside the cost model's measurement
    assert runs["none:quantize=none"]["lossless"] is None  # it is the reference on fp32 weights
    assert 0 <= runs["draft:k=3"]["stats"]["overhead_share"] < 1
    stats = runs["draft:k=3"]["stats"]
    assert 0 < stats["prefill_seconds"] < stats["wall_seconds"]
    cell = saved["summary"]["methods"]["draft:k=3"][saved["summary"]["categories"][-1]]
    expected = (stats["new_tokens"] - 1) / (stats["wall_seconds"] - stats["prefill_seconds"])
    assert cell["decode_tokens_per_second"] == pytest.approx(expected)
    # the draft model's prefill is timed apart, within drafting; prompt lookup has none
    assert 0 < stats["draft_prefill_seconds"] < stats["draft_seconds"]
    assert runs["pld:k=4"]["stats"]["draft_prefill_seconds"] == 0
    parts = cell["time"]
    assert parts["draft_prefill"] == pytest.approx(stats["draft_prefill_seconds"])
    assert parts["target_prefill"] + parts["target_after_prefill"] + parts["draft_prefill"] + parts["drafting"] + (
        parts["rest"]) == pytest.approx(stats["wall_seconds"])
    assert min(parts.values()) >= 0
    report = (out / "report.md").read_text()
    assert "time outside model forwards" in report and "## Where the time goes" in report
    # each run's peak resident memory (reset before it), the method's largest in the summary and the report
    peaks = [r["peak_resident_bytes"] for r in saved["runs"] if r["method"] == "draft:k=3"]
    assert all(p > 0 for p in peaks) and cell["peak_resident_bytes"] == max(peaks)
    assert "peak resident memory" in report and f"{max(peaks) / 2**30:.2f} GiB" in report
    assert saved["resident_after_load"]["total"] > 0


def test_report_of_results_without_the_draft_prefill():
    """results.json written before draft_prefill_seconds existed: its drafting keeps the draft's
    prefill, and the report shows the column as unknown."""
    stats = {"target_forwards": 3, "draft_forwards": 4, "drafted_tokens": 4, "accepted_tokens": 2,
             "accepted_per_position": [2, 0], "draft_seconds": 0.5, "verify_seconds": 1.5, "wall_seconds": 2.1,
             "forward_seconds": 1.9, "prefill_seconds": 0.6, "new_tokens": 5}
    results = {"config": {"target": "t", "draft": "d", "dtype": "float32", "temperature": 0.0, "max_new_tokens": 5,
                          "repeats": 1, "dataset": "x", "chat": False},
               "machine": {"cpu": "c", "cpu_count": 2, "torch_threads": 2, "torch": "2", "transformers": "5", "python": "3"},
               "created": "now", "complete": True,
               "runs": [{"prompt_id": "1", "category": "qa", "method": "draft", "repeat": 0, "new_tokens": 5,
                         "seconds": 2.1, "stats": stats, "lossless": None, "mismatch": None}]}
    summary = report.summarize(results)
    parts = summary["methods"]["draft"]["all"]["time"]
    assert parts["draft_prefill"] is None and parts["drafting"] == pytest.approx(0.5)
    assert parts["rest"] == pytest.approx(0.1) and parts["target_after_prefill"] == pytest.approx(0.9)
    # each forward after the prefill: 0.9 s over 3 - 1 of them; no `none` run to compare with
    assert "| draft | 2.1 | 0.6 (29%) | 0.9 (43%) | 450.0 | – | 0.5 (24%) | 0.1 (5%) |" in report.markdown(results, summary)
    # beside `none`, whose steps after the prefill took (2.1 - 0.4) / (5 - 1) s each: the ratio of the two
    plain = {**stats, "target_forwards": 5, "draft_forwards": 0, "drafted_tokens": 0, "accepted_tokens": 0,
             "accepted_per_position": [], "draft_seconds": 0.0, "draft_prefill_seconds": 0.0, "verify_seconds": 2.1,
             "prefill_seconds": 0.4, "wall_seconds": 2.2}
    results["runs"].insert(0, {**results["runs"][0], "method": "none", "seconds": 2.2, "stats": plain})
    text = report.markdown(results, report.summarize(results))
    assert "| none | 2.2 | 0.4 (18%) | 1.7 (77%) | 425.0 (1.00x) |" in text
    assert "| draft | 2.1 | 0.6 (29%) | 0.9 (43%) | 450.0 (1.06x) |" in text


def test_bench_records_the_draft_weights(folders, tmp_path, dataset):
    require_compiled_kernels()  # int4 has no torch fallback
    out = tmp_path / "int4-draft"
    code = main(["bench", "--target", folders["target"], "--draft", folders["draft"], "--quantize", "int8",
                 "--draft-quantize", "int4", "--methods", "none,draft:k=3", "--dataset", dataset, "--categories", "qa",
                 "--per-category", "1", "--max-new-tokens", "8", "--cost-repeats", "0", "--out", str(out)])
    assert code == 0
    saved = json.loads((out / "results.json").read_text())
    assert saved["config"]["draft_quantize"] == "int4"
    assert all(r["lossless"] is not False for r in saved["runs"])
    text = (out / "report.md").read_text()
    assert "draft weights int4" in text
    # no cost model (--cost-repeats 0): no v(k) plot, and the report names only the plots written
    assert not (out / "v_k.png").exists() and "v_k.png" not in text and "`speedup.png`" in text


def test_each_method_has_its_own_prefix_cache(folders, tmp_path, capsys):
    """Prompts sharing a head: every speclm method reads the first whole and takes the head of the
    later ones from its own cache (never the prompt another method just read); lossless holds."""
    require_compiled_kernels()
    path = tmp_path / "shared-head.jsonl"
    head = "System: answer in one short line, please. User: "
    path.write_text("".join(json.dumps({"id": i, "category": "qa", "prompt": head + q}) + "\n"
                            for i, q in enumerate(["who wrote it?", "where is it?", "when was it?"])))
    for size in ("4096", "0"):
        out = tmp_path / f"cache-{size}"
        code = main(["bench", "--target", folders["target"], "--draft", folders["draft"], "--quantize", "int8",
                     "--methods", "none,draft:k=3,pld:k=4,hf", "--dataset", str(path), "--max-new-tokens", "6",
                     "--cost-repeats", "0", "--prefix-cache", size, "--out", str(out)])
        assert code == 0
        saved = json.loads((out / "results.json").read_text())
        assert saved["config"]["prefix_cache"] == int(size)
        cached = {}
        for r in saved["runs"]:
            if r["stats"]:
                cached.setdefault(r["method"], []).append(r["stats"]["cached_tokens"])
                assert r["stats"]["cached_tokens"] < r["prompt_tokens"]
        assert set(cached) == {"none", "draft:k=3", "pld:k=4"}
        assert all(r["lossless"] is not False for r in saved["runs"] if r["method"] != "hf")
        text = (out / "report.md").read_text()
        if size == "0":
            assert all(c == [0, 0, 0] for c in cached.values()) and "No prefix cache" in text
        else:
            first = cached["none"]
            assert first[0] == 0 and min(first[1:]) >= len(head)  # byte tokens: one per character
            assert all(c == first for c in cached.values())
            assert f"none {sum(first)} of" in text
