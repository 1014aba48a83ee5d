"""`speclm draft distill` on the tiny models: data, training, resuming, loading the result as a draft."""

import json
import math

import pytest
import torch

from speclm import SpecEngine
from speclm.cli import main
from speclm.errors import UsageError

WORDS = ["alpha", "beta", "gamma", "delta", "omega", "kappa"]


def _prompt_file(path, n=24):
    path.write_text("".join(json.dumps({"prompt": f"{WORDS[i % 6]} {WORDS[(i * 5) % 6]} {i}"}) + "\n" for i in range(n)))
    return str(path)


def _args(folders, prompts, out, *extra):
    return ["draft", "distill", "--target", folders["target"], "--draft", folders["draft"], "--prompts", prompts,
            "--out", str(out), "--max-new-tokens", "16", "--max-prompt-tokens", "64", "--shard-size", "8",
            "--valid-fraction", "0.25", "--quantize", "none", *extra]


def _metrics(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_divergences_match_their_definitions():
    from speclm.distill.train import divergences

    g = torch.Generator().manual_seed(0)
    logits, teacher_logits = torch.randn(5, 11, generator=g), torch.randn(5, 11, generator=g)
    teacher = torch.log_softmax(teacher_logits, -1)
    d = divergences(logits, teacher)
    p, q = teacher.exp().double(), torch.softmax(logits.double(), -1)
    assert torch.allclose(d["kl"].double(), (p * (p.log() - q.log())).sum(-1), atol=1e-5)
    assert torch.allclose(d["tvd"].double(), 0.5 * (p - q).abs().sum(-1), atol=1e-6)
    assert d["agree"].tolist() == (logits.argmax(-1) == teacher_logits.argmax(-1)).tolist()
    same = divergences(teacher_logits, teacher)
    assert float(same["kl"].abs().max()) < 1e-5 and float(same["tvd"].max()) < 1e-6 and bool(same["agree"].all())


def test_distilled_lora_draft_learns_the_target_and_loads_as_a_draft(tmp_path, folders, capsys):
    """LoRA on the tiny draft: held-out KL falls and the sampled acceptance (1 - TVD) rises over the run; the folder
    loads with --draft (the adapter merged, then quantized too) and decoding stays the target's own."""
    from speclm.models.loading import load_model

    out = tmp_path / "run"
    prompts = _prompt_file(tmp_path / "p.jsonl")
    assert main(_args(folders, prompts, out, "--adapter", "lora", "--rank", "8", "--lr", "1e-2",
                      "--steps", "80", "--eval-every", "40", "--save-every", "40")) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["adapter"] == "lora" and summary["steps"] == 80 and summary["prompts"] == 24
    valid = [m for m in _metrics(out) if m["split"] == "validation"]
    assert [m["step"] for m in valid] == [0, 40, 80]
    assert valid[-1]["kl"] < 0.7 * valid[0]["kl"], valid
    assert valid[-1]["sampled_acceptance"] > valid[0]["sampled_acceptance"] + 0.05, valid
    for name in ("adapter_config.json", "adapter_model.safetensors", "config.json", "speclm-draft.json",
                 "loss.png", "acceptance.png", "data/target/manifest.json", "data/draft/manifest.json"):
        assert (out / name).is_file(), name

    target = load_model(folders["target"])
    plain = SpecEngine(target).generate(["alpha beta 3", "omega kappa 9"], method="none", max_new_tokens=24)
    for quantize in ("none", "int8"):
        draft = load_model(str(out), quantize=quantize)
        outs = SpecEngine(target, draft=draft).generate(["alpha beta 3", "omega kappa 9"], method="draft",
                                                       max_new_tokens=24, k=4)
        assert [o.token_ids for o in outs] == [p.token_ids for p in plain], quantize
    # the merged weights are the trained ones: the loaded draft agrees with the target as the
    # last validation said (a draft loaded without its adapter agrees as step 0 did)
    from speclm.distill.train import divergences, teacher_logprobs
    from speclm.heads.train import Shards

    data = Shards([out / "data" / "target", out / "data" / "draft"], 81, 0.25)
    batch = data.collate(data.valid_windows)
    teacher = teacher_logprobs(target.model.get_output_embeddings(), batch["features"][batch["mask"]])
    for folder, want in ((str(out), valid[-1]), (folders["draft"], valid[0])):
        model = load_model(folder).model
        with torch.no_grad():
            hidden = model.model(input_ids=batch["tokens"], attention_mask=(~batch["pad"]).long()).last_hidden_state
            d = divergences(model.lm_head(hidden[batch["mask"]]), teacher)
        assert math.isclose(float(d["kl"].mean()), want["kl"], rel_tol=0.02), (folder, float(d["kl"].mean()), want)

    assert main(["models", "list"]) == 0
    assert str(out.resolve()) in capsys.readouterr().out

    # the bench compares drafts in one run, each method with its own: the distilled one, and the
    # target itself as a draft (every drafted token accepted) beside the unrelated stock draft
    bench = tmp_path / "bench"
    dataset = tmp_path / "eval.jsonl"
    dataset.write_text("".join(json.dumps({"prompt": p, "category": "qa"}) + "\n" for p in ("alpha beta 3", "omega kappa 9")))
    labels = ["draft:k=4", f"draft:k=4,draft_model={out}", f"draft:k=4,draft_model={folders['target']}"]
    assert main(["bench", "--target", folders["target"], "--draft", folders["draft"], "--quantize", "none",
                 "--methods", ",".join(["none"] + labels), "--dataset", str(dataset),
                 "--max-new-tokens", "24", "--cost-repeats", "0", "--out", str(bench)]) == 0
    runs = json.loads((bench / "results.json").read_text())["runs"]
    assert {r["method"] for r in runs} == {"none", *labels}
    assert all(r["lossless"] for r in runs if r["method"] != "none")
    rate = {m: sum(r["stats"]["accepted_tokens"] for r in runs if r["method"] == m)
            / sum(r["stats"]["drafted_tokens"] for r in runs if r["method"] == m) for m in labels}
    assert rate[labels[2]] == 1.0 and rate[labels[0]] < 0.5, rate
    capsys.readouterr()
    assert main(["bench", "--target", folders["target"], "--methods", f"none,pld:draft_model={out}",
                 "--dataset", str(dataset), "--out", str(tmp_path / "never")]) == 2
    assert "draft_model=" in capsys.readouterr().err and not (tmp_path / "never").exists()


def test_an_interrupted_run_resumes_to_the_same_weights(tmp_path, folders):
    from safetensors.torch import load_file

    from speclm.distill import train as train_module

    prompts = _prompt_file(tmp_path / "p.jsonl", 16)
    common = ("--steps", "6", "--save-every", "3", "--eval-every", "3", "--samples", "target", "--lr", "1e-3")
    assert main(_args(folders, prompts, tmp_path / "whole", *common)) == 0

    real = train_module.train

    def stop_at_4(*args, **kwargs):
        def hook(step):
            if step == 4:
                raise KeyboardInterrupt
        return real(*args, on_step=hook, **kwargs)

    train_module.train = stop_at_4
    try:
        assert main(_args(folders, prompts, tmp_path / "cut", *common)) == 130
    finally:
        train_module.train = real
    assert json.loads((tmp_path / "cut" / "checkpoint" / "state.json").read_text())["step"] == 3
    assert main(_args(folders, prompts, tmp_path / "cut", *common)) == 0
    a = load_file(str(tmp_path / "whole" / "model.safetensors"))
    b = load_file(str(tmp_path / "cut" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert [m["step"] for m in _metrics(tmp_path / "cut")] == [m["step"] for m in _metrics(tmp_path / "whole")]
    # another plan on the same folder is refused, not mixed in
    assert main(_args(folders, prompts, tmp_path / "cut", "--steps", "6", "--lr", "5e-3", "--samples", "target")) == 2


def test_evaluation_prompts_and_other_tokenizers_are_refused(tmp_path, folders, capsys):
    from speclm.prompts import spec_bench

    turn = spec_bench()[7]["turns"][0]
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "alpha beta"}) + "\n" + json.dumps({"prompt": turn}) + "\n")
    out = tmp_path / "never"
    assert main(_args(folders, str(bad), out, "--steps", "1")) == 2
    err = capsys.readouterr().err
    assert f"{bad}:2" in err and "Spec-Bench" in err and len(err.strip().splitlines()) == 1
    assert not out.exists()
    prompts = _prompt_file(tmp_path / "p.jsonl", 4)
    args = _args(folders, prompts, tmp_path / "other", "--steps", "1")
    args[args.index("--draft") + 1] = folders["other_vocab"]
    assert main(args) == 2
    assert "vocabulary" in capsys.readouterr().err
    with pytest.raises(UsageError, match="builtin:rag"):
        from speclm.distill.data import prompts as prompt_source

        prompt_source("builtin:poetry")


def test_a_method_with_its_own_draft_needs_no_bench_draft(tmp_path, folders):
    dataset = tmp_path / "eval.jsonl"
    dataset.write_text(json.dumps({"prompt": "alpha beta 3", "category": "qa"}) + "\n")
    assert main(["bench", "--target", folders["target"], "--quantize", "none", "--methods",
                 f"none,draft:k=2,draft_model={folders['target']}", "--dataset", str(dataset),
                 "--max-new-tokens", "8", "--cost-repeats", "0", "--out", str(tmp_path / "b")]) == 0
    runs = json.loads((tmp_path / "b" / "results.json").read_text())["runs"]
    assert [r["lossless"] for r in runs if r["method"] != "none"] == [True]
    assert main(["bench", "--target", folders["target"], "--quantize", "none", "--methods", "none,draft:k=2",
                 "--dataset", str(dataset), "--out", str(tmp_path / "c")]) == 2
