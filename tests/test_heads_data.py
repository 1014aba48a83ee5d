"""speclm.heads.sources and speclm.heads.data: prompts with provenance and permissive licences,
evaluation overlap left out, the stored sequences are the target's greedy responses with its
hidden states, and builds resume to the same bits."""

import argparse
import email.message
import hashlib
import json

import pytest
import torch
from safetensors import safe_open
from tiny import loaded, require_compiled_kernels, tiny_model

from speclm import SpecEngine
from speclm.errors import UsageError
from speclm.text import chat_ids
from speclm.heads import data, sources
from speclm.heads.cli import add_data_parser
from speclm.heads.sources import Prompt
from speclm.forward.cache import StaticKV
from speclm.models.loading import LoadedModel, load_model

NEW = 12  # max_new_tokens of the builds here
SHORT = [Prompt.of("math", sources.GENERATED, sources.GENERATED_LICENCE, text) for text in (
    "What is 17 plus 25?",
    "Name a colour.",
    "Write a haiku about tea, please.",
    "Count to five.",
    "Why is the sky blue? Explain briefly.",
    "Say hi.",
)]


def planted() -> Prompt:
    """A Spec-Bench turn, slightly reworded around, among the candidates."""
    turn = next(t for t in data.eval_texts() if 12 <= len(t.split()) <= 40)
    return Prompt.of("qa", "somewhere:copied.py", "MIT", f"Please answer this: {turn}")


def build(target, out, **kw):
    args = dict(prompts=5, max_new_tokens=NEW, max_prompt_tokens=64, batch_size=3, shard_size=2, progress=False,
                candidates=[planted()] + SHORT)
    args.update(kw)
    return data.build(target, out, **args)


@pytest.fixture(scope="module")
def eos_target(tok):
    """A tiny fp32 target whose EOS is a token it generates early for the first prompt, so that
    rows leave both at EOS and at max_new_tokens."""
    model = tiny_model(len(tok), seed=0)
    ids = chat_ids(tok, SHORT[0].text)
    first = SpecEngine(loaded(model, tok)).generate(ids, method="none", max_new_tokens=NEW).token_ids
    return LoadedModel(name="tiny-eos", model=model, tokenizer=tok, eos_token_ids=(first[4],))


def fresh_states(target, ids: list[int]) -> torch.Tensor:
    """The hidden states (after the final norm) of one forward over the whole sequence."""
    kv = StaticKV(target.model, 1, len(ids) + 1)
    kv.forward([ids], 1, hidden_layers=(-1,), hidden_all=True)
    return kv.hidden[-1][0, : len(ids)].float()


# ---------------------------------------------------------------- sources
def test_licences():
    assert sources.is_permissive("MIT")
    assert sources.is_permissive("BSD-3-Clause AND 0BSD AND MIT AND Zlib AND CC0-1.0")
    assert sources.is_permissive("Apache-2.0 AND Apache-2.0 WITH LLVM-exception AND BSL-1.0")
    assert sources.is_permissive("(GPL-2.0-only OR MIT) AND PSF-2.0")
    for bad in ("MPL-2.0 AND MIT", "GPL-3.0-or-later", "LicenseRef-GPL", "", None, "MIT AND (", "Proprietary"):
        assert not sources.is_permissive(bad), bad

    def meta(**fields):
        m = email.message.Message()
        for key, values in fields.items():
            for v in values if isinstance(values, list) else [values]:
                m[key.replace("_", "-")] = v
        return m

    assert sources.licence_of(meta(License_Expression="BSD-3-Clause")) == "BSD-3-Clause"
    assert sources.licence_of(meta(Classifier=["License :: OSI Approved :: MIT License",
                                               "License :: OSI Approved :: Apache Software License"])) == "MIT OR Apache-2.0"
    assert sources.licence_of(meta(License="Apache License, Version 2.0")) == "Apache-2.0"
    assert not sources.is_permissive(sources.licence_of(meta(License="GPLv2")))
    assert sources.licence_of(meta(Name="x")) is None
    found = sources.find_sources()
    assert found[0].name.startswith("python-stdlib") and found[0].licence == "PSF-2.0"
    assert all(sources.is_permissive(s.licence) for s in found)
    assert abs(sum(s.weight for s in found) - 1) < 1e-9
    names = {s.package for s in found}
    assert "torch" in names and "tqdm" not in names and "speclm" not in names  # tqdm: MPL-2.0 AND MIT


def test_prompts_have_provenance_and_permissive_licences():
    prompts = sources.collect(150, seed=0)
    assert len(prompts) == 150 and len({p.id for p in prompts}) == 150
    for p in prompts:
        assert p.id == hashlib.sha1(p.text.encode()).hexdigest()
        assert sources.is_permissive(p.licence), p
        assert p.kind in sources.KIND_WEIGHTS
        assert p.source == sources.GENERATED or p.source.count(":") >= 1, p.source
    kinds = [p.kind for p in prompts]
    assert max(set(kinds), key=kinds.count) == "code" and len(set(kinds)) >= 6
    assert any(p.source.startswith("python-stdlib") for p in prompts)
    assert any(not p.source.startswith(("python-stdlib", sources.GENERATED)) for p in prompts)  # packages too
    assert [p.id for p in sources.collect(40, seed=0)] == [p.id for p in prompts[:40]]  # a prefix: deterministic
    assert [p.id for p in sources.collect(40, seed=1)] != [p.id for p in prompts[:40]]


def test_planted_eval_prompt_is_excluded():
    turns = data.eval_texts()
    short = next(t for t in turns if 3 <= len(t.split()) < 8)  # no 8-gram: caught as a near-duplicate
    near = Prompt.of("qa", "x", "MIT", "  " + short.upper().replace(" ", " ,  ") + "!!")
    innocent = [Prompt.of("qa", "x", "MIT", t) for t in ("What does json.dumps do in Python?", "Say hi.")]
    assert data.overlap([planted(), near] + innocent + SHORT) == {planted().id, near.id}
    assert data.overlap([Prompt.of("qa", "x", "MIT", "one two three four five six seven eight nine")],
                        ["zero one two three four five six seven eight"]) != set()


# ---------------------------------------------------------------- build
def test_build_stores_greedy_responses_and_hidden_states(tmp_path, eos_target, tok):
    manifest = build(eos_target, tmp_path)
    assert manifest["excluded_eval_overlap"] == 1 and manifest["prompts"] == 5
    assert manifest["hidden_size"] == 64 and manifest["vocab_size"] == len(tok) and manifest["layer"] == -1
    assert [s["sequences"] for s in manifest["shards"]] == [2, 2, 1]
    assert manifest["sources"] == [{"source": sources.GENERATED, "licence": sources.GENERATED_LICENCE, "prompts": 5}]
    assert manifest == data.load_manifest(tmp_path)
    for s in manifest["shards"]:
        assert hashlib.sha256((tmp_path / s["file"]).read_bytes()).hexdigest() == s["sha256"]
    assert manifest["data_sha256"] == hashlib.sha256("".join(s["sha256"] for s in manifest["shards"]).encode()).hexdigest()
    lines = [json.loads(line) for line in (tmp_path / "prompts.jsonl").read_text().splitlines()]
    assert [r["id"] for r in lines] == [p.id for p in SHORT[:5]]
    assert lines[0] == SHORT[0].to_dict()
    with safe_open(str(tmp_path / "shard-00000.safetensors"), framework="pt") as f:
        assert json.loads(f.metadata()["prompt_ids"]) == [p.id for p in SHORT[:2]]
        assert {k: f.get_tensor(k).dtype for k in f.keys()} == {
            "tokens": torch.int32, "starts": torch.int64, "prompt_lens": torch.int32, "hidden": torch.bfloat16}

    stored = list(data.iter_sequences(tmp_path))
    assert len(stored) == 5
    engine = SpecEngine(eos_target)
    # the features as generated, fp32: the same shards decoded again, each with the build's company
    chunks = [SHORT[0:2], SHORT[2:4], SHORT[4:5]]
    generated = [h for chunk in chunks for _, _, h in sorted(data.distill(
        eos_target, [chat_ids(tok, p.text) for p in chunk], max_new_tokens=NEW, batch_size=3))]
    stopped = []
    for (tokens, hidden, n), prompt, features in zip(stored, SHORT, generated):
        ids = chat_ids(tok, prompt.text)
        assert tokens[:n].tolist() == ids
        response = tokens[n:].tolist()
        assert response == engine.generate(ids, max_new_tokens=NEW).token_ids  # greedy decoding's tokens
        stopped.append(response[-1] in eos_target.eos_token_ids)
        assert hidden.shape == (len(tokens), 64) and hidden.dtype == torch.bfloat16
        fresh = fresh_states(eos_target, tokens.tolist())
        # fp32 unquantized: the decode forwards' states equal one forward's up to rounding
        # (other matmul shapes, per-query attention), so allclose, not bit-equal
        torch.testing.assert_close(features, fresh, rtol=0, atol=1e-5)
        assert torch.equal(hidden, features.to(torch.bfloat16))  # stored: those states in bf16, bit for bit
    assert any(stopped) and not all(stopped)  # rows left at EOS and at max_new_tokens


def test_resume_gives_the_uninterrupted_shards(tmp_path, eos_target):
    full = build(eos_target, tmp_path / "full")
    hashes = [s["sha256"] for s in full["shards"]]
    stopped = build(eos_target, tmp_path / "stopped", minutes=0)  # stops after its first shard
    assert [s["sha256"] for s in stopped["shards"]] == hashes[:1]
    resumed = build(eos_target, tmp_path / "stopped")
    assert [s["sha256"] for s in resumed["shards"]] == hashes and resumed["data_sha256"] == full["data_sha256"]
    capped = build(eos_target, tmp_path / "capped", prompts=3)  # a last shard cut short, redone longer
    assert [s["sequences"] for s in capped["shards"]] == [2, 1]
    assert build(eos_target, tmp_path / "capped", prompts=5) == full
    assert build(eos_target, tmp_path / "full", prompts=2) == full  # a smaller --prompts keeps what is there


def test_resume_batch_invariant_target(tmp_path, tok):
    """int8 weights on speclm's kernels: the next shard's prompts join while a shard finishes,
    and a resumed build still equals an uninterrupted one."""
    require_compiled_kernels()
    target = load_model(tiny_model(len(tok), seed=0), tokenizer=tok, quantize="int8")
    target.name = "tiny-int8"
    assert StaticKV(target.model, 1, 8).chunk_invariant
    full = build(target, tmp_path / "full", batch_size=4)
    build(target, tmp_path / "stopped", batch_size=4, minutes=0)
    assert build(target, tmp_path / "stopped", batch_size=4) == full
    engine = SpecEngine(target)
    for tokens, _, n in data.iter_sequences(tmp_path / "full"):
        assert tokens[n:].tolist() == engine.generate(tokens[:n].tolist(), method="none", max_new_tokens=NEW).token_ids


def test_other_arguments_for_a_folder_are_a_usage_error(tmp_path, eos_target):
    build(eos_target, tmp_path / "a", prompts=2)
    with pytest.raises(UsageError, match="max_new_tokens=12.*max_new_tokens=13"):
        build(eos_target, tmp_path / "a", prompts=2, max_new_tokens=13)
    with pytest.raises(UsageError, match="seed"):
        build(eos_target, tmp_path / "a", prompts=2, seed=1)
    with pytest.raises(UsageError, match="other prompts"):
        build(eos_target, tmp_path / "a", prompts=2, candidates=SHORT[::-1])
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "notes.txt").write_text("mine")
    with pytest.raises(UsageError, match="other files"):
        build(eos_target, tmp_path / "b", prompts=2)
    with pytest.raises(UsageError, match="batch-size"):
        build(eos_target, tmp_path / "c", batch_size=0)


def test_cli(tmp_path, folders):
    parser = argparse.ArgumentParser()
    add_data_parser(parser.add_subparsers(dest="command"))
    out = tmp_path / "data"
    args = parser.parse_args(["data", "--target", folders["target"], "--out", str(out), "--prompts", "2",
                              "--max-new-tokens", "4", "--max-prompt-tokens", "200", "--shard-size", "2",
                              "--threads", str(torch.get_num_threads())])
    assert args.heads_command(args) == 0
    manifest = data.load_manifest(out)
    assert manifest["target"] == folders["target"] and manifest["quantize"] == "int8"
    assert manifest["prompts"] == 2 and [s["sequences"] for s in manifest["shards"]] == [2]
    assert all(sources.is_permissive(json.loads(line)["licence"]) for line in (out / "prompts.jsonl").open())


# ---------------------------------------------------------------- requests the target writes
def test_assistant_lists_parse_into_prompts():
    from speclm.heads import assistant

    answer = ("Here you go:\n1. What is the tallest mountain in Africa?\n2) **How do bees make honey?**\n"
              "- Why do leaves change colour in autumn?\n3. Short\n* \"Which planet has the most moons?\"\n"
              "Not a list item, though long enough to look like a request.\n")
    assert assistant.parse_list(answer) == [
        "What is the tallest mountain in Africa?", "How do bees make honey?",
        "Why do leaves change colour in autumn?", "Which planet has the most moons?"]
    qa = assistant.to_prompts("qa", "geography", answer)
    assert [p.kind for p in qa] == ["qa"] * 4 and qa[0].text == "What is the tallest mountain in Africa?"
    assert qa[0].source == "speclm-assistant:qa:geography" and qa[0].licence == "Apache-2.0"
    de = assistant.to_prompts("translation", "weather", "1. Morgen wird es in Berlin regnen und kalt sein.")
    assert [(p.kind, p.text) for p in de] == [("translation", "Translate German to English: Morgen wird es in Berlin regnen und kalt sein.")]
    assert [p.kind for p in assistant.to_prompts("writing", "music", answer)] == ["conversation"] * 4
    seeds = assistant.seed_requests(0)
    assert len(seeds) == len(assistant.STYLES) * len(assistant.DOMAINS) == len({s for _, _, s in seeds})
    assert seeds == assistant.seed_requests(0) != assistant.seed_requests(1)


def _fake_answers(calls):
    def answer(texts):
        calls.append(len(texts))
        return [f"1. Please explain request number {abs(hash(t)) % 10**6} in detail.\n"
                f"2. What is the story behind item {len(t)} of this list?" for t in texts]
    return answer


def test_assistant_stream_keeps_answers_and_resumes(tmp_path):
    from itertools import islice

    from speclm.heads import assistant

    calls = []
    first = list(islice(assistant.stream(_fake_answers(calls), tmp_path, batch_size=4), 10))
    assert calls == [4, 4] and len(first) == 10  # two prompts per seed request: three batches' worth asked, two answered
    again = []
    assert list(islice(assistant.stream(_fake_answers(again), tmp_path, batch_size=4), 10)) == first
    assert again == []  # kept answers are not decoded again
    lines = (tmp_path / assistant.FILE).read_text().splitlines()
    (tmp_path / assistant.FILE).write_text("\n".join(lines[:5]) + "\n" + lines[5][:20])  # a write cut short
    assert list(islice(assistant.stream(_fake_answers(again), tmp_path, batch_size=4), 10)) == first
    assert again == [3]  # the cut line and those after it, of the second batch


def test_build_from_requests_the_target_writes(tmp_path, eos_target, tok, monkeypatch):
    """source="assistant": prompts parsed from the target's answers to the seed requests, each
    stored with its greedy response; a planted evaluation turn among them is left out; a folder's
    source is part of its identity; the answerer decodes greedily with the target."""
    from speclm.heads import assistant

    turn = planted().text
    monkeypatch.setattr(data, "_answerer", lambda target, batch, progress: lambda texts: [
        f"1. {turn}\n2. Describe a sunny day at the beach in three sentences.\n3. {t[:60]}" for t in texts])
    manifest = data.build(eos_target, tmp_path / "a", prompts=4, max_new_tokens=NEW, max_prompt_tokens=200,
                          batch_size=3, shard_size=2, progress=False, source="assistant")
    assert manifest["source"] == "assistant" and manifest["excluded_eval_overlap"] >= 1
    assert [s["source"] for s in manifest["sources"]] == [assistant.SOURCE]
    rows = [json.loads(line) for line in (tmp_path / "a" / "prompts.jsonl").read_text().splitlines()]
    assert len(rows) == 4 and all(turn not in r["text"] for r in rows)
    assert all(r["source"].startswith(assistant.SOURCE + ":") for r in rows)
    engine = SpecEngine(eos_target)
    for (tokens, _, n), row in zip(data.iter_sequences(tmp_path / "a"), rows):
        assert tokens[:n].tolist() == chat_ids(tok, row["text"])
        assert tokens[n:].tolist() == engine.generate(tokens[:n].tolist(), method="none", max_new_tokens=NEW).token_ids
    with pytest.raises(UsageError, match="source=assistant.*source=library"):
        build(eos_target, tmp_path / "a", prompts=2)
    with pytest.raises(UsageError, match="source must be"):
        build(eos_target, tmp_path / "b", source="web")
    monkeypatch.undo()
    ids = chat_ids(tok, "Say hi.")
    answer = data._answerer(eos_target, 2, False)(["Say hi."])
    expected = engine.generate(ids, max_new_tokens=min(assistant.MAX_NEW_TOKENS, eos_target.max_context - len(ids) - 1)).token_ids
    assert answer == [tok.decode(expected, skip_special_tokens=True)]
