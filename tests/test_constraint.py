"""Constrained decoding (speclm.constraint) with every method: greedy output is constrained plain
decoding's, token for token, and parses; sampled output follows the constrained target
distribution exactly; bad constraints are refused in one line; planted bugs fail the checks.

The sampling checks (chi-square, tests/chisq.py's ALPHA each) run on a tiny model of seven
one-character tokens under a regex that allows 3, 3, 3 and 2 of them at the four positions
counted (as test_sampling_distribution.py counts: the prefill's token and a whole drafting
round of K = 2; llguidance reads the tokens through a small wrapper). The exact joint is computed from the target's logits with the forbidden
words at -inf, then temperature. Ten checks run here (tests/chisq.py's total counts them).
"""

from __future__ import annotations

import json
import re

import jsonschema
import numpy as np
import pytest
import torch

import speclm.constraint as constraint_mod
import speclm.engine as engine_mod
from chisq import ALPHA, chisq_pvalue, joint
from speclm import SpecEngine
from speclm.constraint import Constraint
from speclm.errors import UsageError
from speclm.options import GenerationOptions
from speclm.sampling import SamplingParams
from tiny import loaded, random_heads, random_plan, tiny_model, word_tokenizer

N = 48
SCHEMA = {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 99}, "tag": {"enum": ["ab", "ba", "c"]},
                                          "note": {"type": "string", "maxLength": 6}},
          "required": ["id", "tag", "note"], "additionalProperties": False}
LARK = 'start: "[" item ("," item)* "]"\nitem: /[0-9]{1,3}/\n'
GBNF = 'root ::= "(" [ab]+ ")" [xy]*\n'
REGEX = r"(ab|ba|aab)+c?x{2,}"
CONSTRAINTS = {
    "regex": {"regex": REGEX},
    "json_object": {"response_format": {"type": "json_object"}},
    "json_schema": {"response_format": {"type": "json_schema", "json_schema": {"name": "t", "schema": SCHEMA}}},
    "lark": {"grammar": LARK},
    "gbnf": {"grammar": GBNF},
}
PROMPTS = ["ab ab ba aab x", '{"id": 12, "tag": "ab", "note": "hi"} {"id": 1', "[1,2,3] [4,5"]


def valid(kind: str, text: str) -> bool:
    """A finished output satisfies its constraint."""
    if kind == "regex":
        return re.fullmatch(REGEX, text) is not None
    if kind == "gbnf":
        return re.fullmatch(r"\([ab]+\)[xy]*", text) is not None
    if kind == "lark":
        return re.fullmatch(r"\[[0-9]{1,3}(,[0-9]{1,3})*\]", text) is not None
    value = json.loads(text)
    if kind == "json_schema":
        jsonschema.validate(value, SCHEMA)
    return isinstance(value, dict)


@pytest.fixture(scope="module")
def heads(tmp_path_factory, target):
    folder = tmp_path_factory.mktemp("constraint-heads")
    return {kind: random_heads(kind, target.model, folder / f"{kind}.safetensors", seed=5, std=0.5)
            for kind in ("medusa", "eagle")}


def methods(heads):
    return [("pld", {}), ("draft", {}), ("draft", {"tree": "auto"}), ("draft", {"alternatives": 1.0}),
            ("draft+pld", {}), ("medusa", {"heads": heads["medusa"]}), ("eagle", {"heads": heads["eagle"]}),
            ("eagle+pld", {"heads": heads["eagle"]}),
            ("lookahead", {"lookahead": (2, 3, 2)}), ("lookahead+pld", {}),
            ("self", {"layers": "1", "self_weights": "target"}), ("auto", {"heads": heads["eagle"]})]


@pytest.fixture(scope="module")
def engines(target, unrelated_draft):
    """One engine whose draft is the target itself (its drafts are accepted where the constraint
    allows them: long accepted paths, forbidden nodes cut mid-draft) and one whose draft is unrelated."""
    return [SpecEngine(target, draft=target), SpecEngine(target, draft=unrelated_draft)]


@pytest.mark.parametrize("kind", list(CONSTRAINTS))
def test_greedy_output_is_constrained_plain_decoding(engines, heads, kind):
    given = CONSTRAINTS[kind]
    for engine in engines:
        refs = [engine.generate(p, method="none", max_new_tokens=N, **given) for p in PROMPTS]
        for r in refs:
            assert r.finish_reason == "length" or valid(kind, r.text), (kind, r.text)
        assert any(r.finish_reason == "stop" for r in refs) or kind.startswith("json"), [r.text for r in refs]
        for method, options in methods(heads):
            outs = [engine.generate(p, method=method, max_new_tokens=N, **given, **options) for p in PROMPTS]
            assert [o.token_ids for o in outs] == [r.token_ids for r in refs], (kind, method, options)
        # seeded sampling: every token is plain decoding's draw with the seed, whatever was drafted
        refs = [engine.generate(p, method="none", max_new_tokens=N, temperature=0.8, seed=3, **given) for p in PROMPTS]
        for method, options in methods(heads)[::3]:
            outs = [engine.generate(p, method=method, max_new_tokens=N, temperature=0.8, seed=3, **given, **options)
                    for p in PROMPTS]
            assert [o.token_ids for o in outs] == [r.token_ids for r in refs], (kind, method, options)


def test_constrained_and_free_requests_share_a_batch(engines, heads):
    """Each request in a batch of mixed constraints (and none) commits what it commits alone."""
    engine = engines[0]
    kinds = list(CONSTRAINTS) + [None]
    for method, options in [("draft+pld", {}), ("eagle+pld", {"heads": heads["eagle"]}), ("auto", {"heads": heads["eagle"]})]:
        alone = [engine.generate(PROMPTS[i % 3], method=method, max_new_tokens=N, **(CONSTRAINTS[k] if k else {}),
                                 **options).token_ids for i, k in enumerate(kinds)]
        batch = engine.batch(rows=len(kinds))
        requests = [batch.join(engine.request(PROMPTS[i % 3], method=method, max_new_tokens=N, index=i,
                                              **(CONSTRAINTS[k] if k else {}), **options)) for i, k in enumerate(kinds)]
        while batch.active:
            batch.step()
        assert [r.generated for r in requests] == alone, method


def test_constraint_time_is_reported(engines):
    out = engines[0].generate(PROMPTS[1], method="draft+pld", max_new_tokens=N, **CONSTRAINTS["json_schema"])
    assert out.stats.constraint_seconds > 0
    assert "constraint_seconds" in out.stats.to_dict()
    free = engines[0].generate(PROMPTS[1], method="draft+pld", max_new_tokens=N)
    assert free.stats.constraint_seconds == 0


def _cut_nodes(engine, monkeypatch, **options) -> tuple[int, int]:
    """(nodes drafted, nodes the constraint forbids) over the prompts and constraint kinds."""
    counts = [0, 0]
    real = constraint_mod.Matcher.masks

    def masks(self, tokens, parents):
        out = real(self, tokens, parents)
        counts[0] += sum(p != -2 for p in parents)
        counts[1] += len(out[1])
        return out

    monkeypatch.setattr(constraint_mod.Matcher, "masks", masks)
    for given in CONSTRAINTS.values():
        for p in PROMPTS:
            engine.generate(p, max_new_tokens=N, **given, **options)
    return counts[0], counts[1]


DRAFTERS = [("draft", {}), ("draft", {"tree": "auto"}), ("self", {"layers": "1", "self_weights": "target"}),
            ("self", {"layers": "1", "self_weights": "target", "tree": "auto"})]


def _unmasked(monkeypatch) -> None:
    """Drafters see every token allowed (the constraint not applied to the draft's distribution)."""
    monkeypatch.setattr(constraint_mod.Matcher, "allowed", lambda self, width, columns=None: torch.ones(
        width if columns is None else len(columns), dtype=torch.bool))


@pytest.mark.parametrize("sampling", [{}, {"temperature": 0.8}, {"temperature": 0.8, "seed": 2}])
@pytest.mark.parametrize("method,options", DRAFTERS, ids=lambda v: str(v))
def test_a_drafting_model_drafts_only_what_the_constraint_allows(engines, monkeypatch, sampling, method, options):
    """A draft model's (and self's) distribution is masked before it picks (greedy) or draws
    (sampling) each token, chains and trees, so the round cuts nothing of their drafts; a planted
    bug, the mask not applied to the draft, leaves forbidden tokens for the round to cut."""
    drafted, cut = _cut_nodes(engines[1], monkeypatch, method=method, **options, **sampling)
    assert drafted > 100 and cut == 0
    _unmasked(monkeypatch)
    drafted, cut = _cut_nodes(engines[1], monkeypatch, method=method, **options, **sampling)
    assert cut > 0


# ---------------------------------------------------------------- planted bugs fail the greedy check

def _differs_or_breaks(engines, heads) -> bool:
    """Whether any greedy output differs from constrained plain decoding's, or decoding raises."""
    given = CONSTRAINTS["json_schema"]
    try:
        for engine in engines:
            for p in PROMPTS:
                ref = engine.generate(p, method="none", max_new_tokens=N, **given)
                for method, options in methods(heads):
                    if engine.generate(p, method=method, max_new_tokens=N, **given, **options).token_ids != ref.token_ids:
                        return True
    except Exception:
        return True
    return False


def test_a_matcher_not_rolled_back_fails(engines, heads, monkeypatch):
    """masks() leaves the matcher one token down each branch it walked: the next masks are wrong."""
    real = constraint_mod.Matcher.masks

    def masks(self, tokens, parents):
        out = real(self, tokens, parents)
        walked = [t for t, p in zip(tokens, parents) if p == -1][:1]
        if walked and out[0][0].numel() and self.allows(out[0][0], walked[0]):
            self._m.consume_token(walked[0])
        return out

    monkeypatch.setattr(constraint_mod.Matcher, "masks", masks)
    assert _differs_or_breaks(engines, heads)


def test_masks_at_the_root_only_fail(engines, heads, monkeypatch):
    """Each node's mask not applied (the target's logits after a drafted token left whole)."""
    real = constraint_mod.Matcher.masks

    def masks(self, tokens, parents):
        out, forbidden, ends = real(self, tokens, parents)
        out[1:] = -1
        return out, forbidden, ends

    monkeypatch.setattr(constraint_mod.Matcher, "masks", masks)
    assert _differs_or_breaks(engines, heads)


# ---------------------------------------------------------------- bad constraints: one line each

@pytest.mark.parametrize("given,message", [
    ({"regex": "(ab"}, "regex"),
    ({"grammar": "start: missing_rule\n"}, "grammar"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": []}}}, "json schema"),
    ({"response_format": "json"}, "response_format"),
    ({"regex": "a", "grammar": 'start: "a"'}, "one constraint per request"),
    ({"regex": ""}, "regex"),
    ({"regex": "a+", "ignore_eos": True}, "ignore-eos"),
])
def test_bad_constraints_are_refused(given, message):
    with pytest.raises(UsageError, match=re.escape(message)) as e:
        GenerationOptions(**given)
    assert "\n" not in str(e.value)


def test_text_response_format_is_no_constraint():
    assert GenerationOptions(response_format={"type": "text"}).constraint is None
    assert GenerationOptions(regex="a+").proposer_key() == GenerationOptions().proposer_key()
    assert Constraint.of(grammar=GBNF).kind == "grammar"


# ---------------------------------------------------------------- the constrained distribution, exactly

V = 7  # tokens a b c d e x and <eos> (id 6), one character each
DEPTH = 4
K = 2
SAMPLES = 6000
SEED = 11
ALLOWED = [(0, 1, 2), (1, 2, 3), (0, 2, 4), (1, 3)]  # the tokens allowed at positions 1..4
CHAR_REGEX = "[abc][bcd][ace][bd]x+"  # the same, never complete within DEPTH tokens
PROMPT_IDS = [0, 1, 2, 0, 1, 4, 1, 3, 0, 1, 2, 0, 1]  # repeats, so prompt lookup proposes
T1 = SamplingParams(temperature=1.0)


class _Chars:
    """Seven one-character tokens as llguidance reads a tokenizer (the tiny word tokenizer of the
    model is not byte-level; llguidance needs tokens that spell every string the regex takes)."""

    def __init__(self):
        self.eos_token_id, self.bos_token_id = V - 1, None
        self.tokens = [b"a", b"b", b"c", b"d", b"e", b"x", b"<eos>"]
        self.special_token_ids = [V - 1]

    def __call__(self, text):
        text = text.decode() if isinstance(text, bytes) else text
        return ["abcdex".index(ch) for ch in text if ch in "abcdex"]


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    import llguidance

    tok = word_tokenizer(V)
    target = loaded(tiny_model(V, seed=3, init=0.15), tok, name="t", eos=False)
    draft = loaded(tiny_model(V, seed=4, layers=1, init=0.15), tok, name="d", eos=False)
    folder = tmp_path_factory.mktemp("constraint-small")
    eagle = random_heads("eagle", target.model, folder / "eagle.safetensors", seed=6, std=0.5)
    chars = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Chars()), n_vocab=V)
    return target, draft, chars, eagle


def exact_constrained_joint(target, prompt_ids, params) -> np.ndarray:
    """P(first DEPTH tokens) under the target's distribution with forbidden tokens at -inf."""
    return joint(target.model, prompt_ids, params, ALLOWED[:DEPTH])


def constrained_pvalue(small, monkeypatch, method, params, options, samples: int = SAMPLES) -> float:
    from unittest import mock

    target, draft, chars, eagle = small
    monkeypatch.setattr(engine_mod, "tokenizer_for", lambda *args: chars)
    engine = SpecEngine(target, draft=draft if method != "none" else None)
    if method == "auto":
        random_plan(engine, SEED)
    options = {"heads": eagle, **options} if method in ("eagle+pld", "auto") else options
    prompt_ids = PROMPT_IDS
    coupled = options.pop("coupled", False)
    if options.pop("unmasked", False):
        _unmasked(monkeypatch)
    run = lambda seed: engine.generate([prompt_ids] * samples, method=method, k=K, max_new_tokens=DEPTH,  # noqa: E731
                                       seed=seed, temperature=params.temperature, top_k=params.top_k,
                                       top_p=params.top_p, regex=CHAR_REGEX, **options)
    if coupled:
        outs = run(SEED)
    else:
        with mock.patch("speclm.engine.secrets.randbits", lambda bits: SEED):
            outs = run(None)
    counts = np.zeros((V,) * DEPTH)
    for o in outs:
        counts[tuple(o.token_ids[:DEPTH])] += 1
    return chisq_pvalue(counts, exact_constrained_joint(target, prompt_ids, params))


SAMPLING_CASES = {
    "plain": ("none", T1, {}),
    # the draft model's chain samples from its distribution masked by the constraint
    "draft": ("draft", T1, {}),
    "draft-top": ("draft", SamplingParams(temperature=0.7, top_k=4, top_p=0.9), {}),
    "draft-tree": ("draft", T1, {"tree": "auto"}),
    # a draft sampling from its own distribution (none does, the constraint masks them all; here
    # planted): forbidden draws stay as leaves for the verifier to reject against its residual
    "draft-unmasked": ("draft", T1, {"unmasked": True}),
    "draft+pld": ("draft+pld", T1, {}),
    "eagle+pld": ("eagle+pld", T1, {}),
    "lookahead": ("lookahead", T1, {"lookahead": (2, 3, 2)}),
    "auto": ("auto", T1, {}),
    "coupled-draft+pld": ("draft+pld", SamplingParams(temperature=0.8, top_k=4), {"coupled": True}),
}


@pytest.mark.parametrize("case", list(SAMPLING_CASES))
def test_sampled_tokens_follow_the_constrained_distribution(small, monkeypatch, case):
    method, params, options = SAMPLING_CASES[case]
    assert constrained_pvalue(small, monkeypatch, method, params, dict(options)) > ALPHA


def test_dropping_a_sampled_forbidden_draft_token_fails(small, monkeypatch):
    """Planted bug: a forbidden token the draft sampled is dropped from the tree instead of kept
    for the verifier to reject (the row then draws from p, not from the residual max(0, p - q))."""
    import speclm.round.batch as batch_mod

    real = batch_mod._fence

    def fence(group, tree):
        class Greedy:  # _fence drops forbidden nodes of greedy rows
            def __init__(self, group):
                self.requests, self.options = group.requests, group.options.__class__(temperature=0.0)
        return real(Greedy(group), tree)

    monkeypatch.setattr(batch_mod, "_fence", fence)
    # drafts sampled from the draft's own distribution (as draft-unmasked, which passes)
    assert constrained_pvalue(small, monkeypatch, "draft", T1, {"unmasked": True}) < ALPHA


def test_masks_not_applied_fail_the_distribution(small, monkeypatch):
    """Planted bug: the drafted nodes' masks not applied (the root's is), and the matcher's own
    refusal of a forbidden committed token silenced: the counts alone catch it."""
    real = constraint_mod.Matcher.masks
    monkeypatch.setattr(constraint_mod.Matcher, "commit", lambda self, tokens: self._m.consume_tokens(tokens))

    def masks(self, tokens, parents):
        out, forbidden, ends = real(self, tokens, parents)
        out[1:] = -1
        return out, forbidden, ends

    monkeypatch.setattr(constraint_mod.Matcher, "masks", masks)
    assert constrained_pvalue(small, monkeypatch, "draft+pld", T1, {}, samples=SAMPLES // 6) < ALPHA


# ---------------------------------------------------------------- the command line

def test_command_line_constraints(folders, tmp_path, capsys):
    from speclm.cli import main

    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps(SCHEMA))
    grammar = tmp_path / "list.lark"
    grammar.write_text(LARK)
    base = ["generate", "--target", folders["target"], "--draft", folders["draft"], "--max-new-tokens", str(N), "--json",
            "--prompt", PROMPTS[2]]
    for flags, kind in ((["--regex", REGEX], "regex"), (["--grammar", str(grammar)], "lark"),
                        (["--json-schema", str(schema)], "json_schema"), (["--json-object"], "json_object")):
        outs = []
        for method in ("none", "draft+pld"):
            assert main(base + ["--method", method] + flags) == 0
            outs.append(json.loads(capsys.readouterr().out))
        assert outs[0]["token_ids"] == outs[1]["token_ids"], kind
        assert outs[0]["finish_reason"] == "length" or valid(kind, outs[0]["text"]), outs[0]["text"]
    for flags, said in ((["--regex", "(ab"], "regex"), (["--json-schema", str(tmp_path / "missing.json")], "missing.json"),
                        (["--regex", "a", "--json-object"], "not allowed with")):
        assert main(base + flags) == 2
        err = capsys.readouterr().err.strip()
        assert said in err and len(err.splitlines()) == 1, err

