"""`speclm tune`: what auto plans by, measured once per machine and model pair, not in a request.

A profile holds, for each of auto's children on this engine (speclm.methods.children), what a
short run of it on the tuning prompts below measured: a draft forward's seconds (one row; a
lookup's: one proposal's), the probability that the target accepts its next drafted token, and
the tokens it gains, the nodes it verifies and the draft forwards it runs per drafting round (a
tree's drafting costs its levels drafted, not its most). The target's and the draft
model's forward costs by tokens read (speclm.forward.costs) are measured beside it (they are
kept in their own files). The planner (speclm.round.adaptive) starts from the profile: a child
is priced by its measured step before it runs in this process, and a request's acceptance of a
child starts from the profile's instead of a flat prior.

A profile is kept in `$SPECLM_HOME/profiles/`, its file named by the target and draft (name and
weights), the heads, the processor and thread count, and the compiled kernels' build
(speclm.forward.costs.cache_path): a profile from another CPU, model or build is never read. The
tuning prompts are the project's own, never an evaluation set's.

`speclm tune` with `--quantize auto` (its default) measures this for every weight mode auto
chooses between (WEIGHT_MODES: int8, and gguf where the target is a GGUF speclm's kernels read),
then races `auto` on them, prompt by prompt, interleaved, and keeps the faster mode in
`$SPECLM_HOME/weights/` (keyed like a profile, by target and draft): `--quantize auto` loads it.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import asdict, dataclass, field, replace

from tqdm.auto import tqdm

from speclm.errors import UsageError
from speclm.files import atomic_write
from speclm.forward.costs import cache_path
from speclm.options import GenerationOptions

FORM = 4  # the profile file's layout (4: `+pld` children measured as they draft in auto); another is measured again
# --quantize auto chooses between these by `race`: int8 (a finer rounding of any weights) and the GGUF's
# own blocks; never int4 (a second, coarser rounding of a GGUF's values) nor fp32 (slower wherever they run)
WEIGHT_MODES = ("int8", "gguf")
RACE_PASSES = 2  # passes over the tuning prompts, the modes' order reversed in the second
TOKENS = 64  # new tokens per tuning prompt
# Tuning prompts: a few kinds of work a user asks for (code, rewriting given text, explaining,
# a list, quoting from given text, arithmetic in steps), written for speclm; none is from
# Spec-Bench or any test set.
PROMPTS = (
    "Write a Python function that merges two sorted lists into one sorted list, with a docstring.",
    "Rewrite this sentence in plain words: The committee has determined that the allocation of resources "
    "shall be deferred until such time as the requisite documentation has been furnished by all parties.",
    "Explain in three sentences why a hash table lookup takes constant time on average.",
    "List five things to check before deploying a web service to production, one line each.",
    "Release notes of a command-line tool:\n- Added a --json flag to the list command.\n- The cache folder "
    "moved from ~/.tool to ~/.cache/tool.\n- Fixed a crash when the config file is empty.\n- Dropped support "
    "for Python 3.8.\nWhich of these changes could break an existing user's setup? Quote each one and say why.",
    "A train leaves at 9:40 and arrives at 13:15. A second train leaves at 10:05 and its trip takes 20 minutes "
    "less. When does the second train arrive? Show each step.",
)


@dataclass
class ChildProfile:
    """One child method's measurements on the tuning prompts."""

    step_seconds: float  # a draft forward over one row (a lookup: one proposal)
    acceptance: float  # P(the target accepts the next drafted token), over its drafting rounds
    gained: float  # accepted tokens per drafting round
    nodes: float  # verified nodes per drafting round
    rounds: int  # drafting rounds measured
    forwards: float  # draft forwards per drafting round (a tree's: its levels drafted; a lookup round's: 0)
    # a chain's rounds by draft position j (a round that drafted nothing included): the share that
    # drafted position j, and the share that accepted positions 0..j (its acceptance is not geometric)
    drafted_at: list[float] = field(default_factory=list)
    accepted_at: list[float] = field(default_factory=list)
    # seconds per prompt token of the child's reading of its prompts (heads: the target's features; what
    # heads would read after sitting rounds out is priced so; a draft model's reading: by its cost line)
    reading_seconds: float = 0.0

    def by_position(self, k: int) -> list[tuple[float, float]]:
        """[(P(position j drafted), P(positions 0..j accepted)) for j < k] of a chain capped at k,
        as its rounds went (past its longest draft: never drafted); [] where none was measured."""
        if not self.drafted_at:
            return []
        return [(self.drafted_at[j], min(self.accepted_at[j], self.drafted_at[j])) if j < len(self.drafted_at)
                else (0.0, 0.0) for j in range(k)]

    def forwards_per_position(self) -> float | None:
        """A chain's draft forwards per position drafted; None where it drafted nothing."""
        drafted = sum(self.drafted_at)
        return self.forwards / drafted if drafted > 0 else None


@dataclass
class Profile:
    key: str
    processor: str
    created: str
    seconds: float  # the measuring took
    children: dict[str, ChildProfile] = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps({"form": FORM, **asdict(self)}, indent=1)

    @staticmethod
    def from_json(text: str) -> "Profile":
        data = json.loads(text)
        if data.get("form") != FORM:
            raise ValueError("another layout")
        kids = {name: ChildProfile(**c) for name, c in data["children"].items()}
        return Profile(data["key"], data["processor"], data["created"], float(data["seconds"]), kids)


@dataclass
class WeightsChoice:
    """What `speclm tune` measured for --quantize auto: `auto`'s tokens per second on each weight mode
    (the tuning prompts, RACE_PASSES passes, modes interleaved), and the faster one."""

    mode: str
    tokens_per_second: dict[str, float]
    created: str

    def describe(self) -> str:
        speeds = ", ".join(f"{m} {t:.1f}" for m, t in sorted(self.tokens_per_second.items(), key=lambda kv: -kv[1]))
        return f"{self.mode} weights (speclm tune, {self.created[:10]}: auto ran {speeds} tokens/s)"


def _choice_path(target: str, draft: str | None):
    return cache_path("weights", f"{target}+{draft or 'no-draft'}", None)


def chosen_weights(target: str, draft: str | None) -> WeightsChoice | None:
    """The weight mode `speclm tune` chose for this target and draft on this processor, thread count
    and kernel build, or None where it measured none."""
    try:
        data = json.loads(_choice_path(target, draft).read_text())
        choice = WeightsChoice(str(data["mode"]), {str(m): float(t) for m, t in data["tokens_per_second"].items()},
                               str(data["created"]))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    return choice if choice.mode in WEIGHT_MODES else None


def race(engines: dict, opts: GenerationOptions, progress: bool | None = None, clock=time.perf_counter) -> dict[str, float]:
    """`auto`'s tokens per second on each engine (weight mode -> SpecEngine over those weights) over
    the tuning prompts, prefill included: RACE_PASSES passes, each prompt run on every engine in
    turn, the engines' order reversed every other pass, so a drift of this machine's speed during
    the race falls on all of them alike."""
    modes = list(engines)
    first = engines[modes[0]]
    chat = bool(getattr(first.target.tokenizer, "chat_template", None))
    prompts = [p for p in PROMPTS if _fits(first, p, chat)] or PROMPTS[:1]
    auto = dict(method="auto", heads=opts.heads, chat=chat)
    for engine in engines.values():  # warm-up: first-call allocations, the planner's setup
        engine.generate("Hi", max_new_tokens=4, **auto)
    spent, made = dict.fromkeys(modes, 0.0), dict.fromkeys(modes, 0)
    bar = tqdm(total=RACE_PASSES * len(prompts) * len(modes), desc="race", unit="run", file=sys.stderr,
               disable=progress is False)
    for turn in range(RACE_PASSES):
        for prompt in prompts:
            for mode in (modes if turn % 2 == 0 else modes[::-1]):
                t0 = clock()
                out = engines[mode].generate(prompt, max_new_tokens=TOKENS, **auto)
                spent[mode] += clock() - t0
                made[mode] += len(out.token_ids)
                bar.update()
    bar.close()
    return {m: made[m] / spent[m] if spent[m] > 0 else 0.0 for m in modes}


def choose_weights(target: str, draft: str | None, speeds: dict[str, float]) -> WeightsChoice:
    """Keep a race's fastest mode for --quantize auto (a tie: the first in WEIGHT_MODES)."""
    best = max(speeds, key=lambda m: (speeds[m], -WEIGHT_MODES.index(m)))
    choice = WeightsChoice(best, dict(speeds), time.strftime("%Y-%m-%dT%H:%M:%S%z"))
    path = _choice_path(target, draft)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, json.dumps(asdict(choice), indent=1))
    except OSError:
        pass  # an unwritable home: --quantize auto stays int8
    return choice


def key_of(engine, opts: GenerationOptions) -> str:
    """The pair and heads a profile is for (the processor and build are added by cache_path)."""
    t, d = engine.target, engine.draft
    draft = f"{d.name}-{d.quantize}" if d is not None else "no-draft"
    heads = os.path.basename(opts.heads) if opts.heads else "shipped-heads"
    return f"{t.name}-{t.quantize}+{draft}+{heads}"


def path_of(engine, opts: GenerationOptions):
    return cache_path("profiles", key_of(engine, opts), engine.target.model)


def load(engine, opts: GenerationOptions) -> Profile | None:
    """The stored profile for this engine, or None (also where it lacks one of auto's children here:
    measured before the registry planned that method)."""
    from speclm.methods import children

    try:
        profile = Profile.from_json(path_of(engine, opts).read_text())
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return profile if all(o.method in profile.children for o in children(engine, opts, False)) else None


def estimate_seconds(engine, opts: GenerationOptions) -> float:
    """About how long `measure` takes here: each child's tuning tokens at a plain step each."""
    from speclm.methods import children

    return len(children(engine, opts, False)) * len(PROMPTS) * (TOKENS + 8) * engine.forward_costs()(1) * 1.3


def _fits(engine, prompt: str, chat: bool) -> bool:
    """Whether the prompt and its tuning tokens fit the target's context."""
    limit = engine.target.max_context
    try:
        return not limit or len(engine.encode([prompt], chat)[0]) + TOKENS < limit
    except UsageError:
        return False


def measure(engine, opts: GenerationOptions, progress: bool | None = None, fallback: bool = True) -> Profile:
    """Run each of auto's children on the tuning prompts (after the forward cost tables) and keep
    what they measured; stored where the home is writable. fallback: set up and measure the
    fallback children too (self: a calibration and an int4 copy; `speclm tune` does, a request
    that finds no profile does not)."""
    from speclm.forward.costs import _processor
    from speclm.methods import REGISTRY, children

    t0 = time.perf_counter()
    engine.forward_costs()
    if engine.draft is not None:
        engine.draft_costs()
    kids = children(engine, opts, fallback)
    chat = bool(getattr(engine.target.tokenizer, "chat_template", None))
    prompts = [p for p in PROMPTS if _fits(engine, p, chat)] or PROMPTS[:1]  # a short context (tests' tiny models)
    lengths = {p: len(engine.encode([p], chat)[0]) for p in prompts}  # prompt tokens a child reads
    bar = tqdm(total=len(kids) * len(prompts), desc="tune", unit="run", file=sys.stderr, disable=progress is False)
    profile = Profile(key_of(engine, opts), _processor(engine.target.model), time.strftime("%Y-%m-%dT%H:%M:%S%z"), 0.0)
    for child in kids:
        bar.set_postfix_str(child.method)
        name, method = child.method, REGISTRY[child.method].drafts_as or child.method  # as it drafts in auto
        child = replace(child, method=method)
        engine.prepare(child)
        engine.generate("Hi", method=method, heads=child.heads, max_new_tokens=4, chat=chat)  # warm-up
        step = forwards = accepted = tries = rounds = nodes = reading = read = 0.0
        drafted_at, accepted_at = [], []  # rounds by draft position, over every prompt
        for prompt in prompts:
            out = engine.generate(prompt, method=method, heads=child.heads, max_new_tokens=TOKENS, chat=chat)
            s = out.stats
            drafting = s.draft_seconds - s.draft_prefill_seconds
            rounds_here = max(0, s.target_forwards - 1)
            step += drafting
            forwards += s.draft_forwards
            accepted += s.accepted_tokens
            tries += min(s.drafted_tokens, s.accepted_tokens + rounds_here)
            nodes += s.verified_nodes
            rounds += rounds_here
            reading += s.draft_prefill_seconds
            read += lengths[prompt]
            for total, counts in ((drafted_at, s.drafted_per_position), (accepted_at, s.accepted_per_position)):
                total.extend([0.0] * (len(counts) - len(total)))
                for j, n in enumerate(counts):
                    total[j] += n
            bar.update()
        per = step / forwards if forwards else step / max(rounds, 1)
        profile.children[name] = ChildProfile(
            step_seconds=per, acceptance=accepted / tries if tries else 0.0, gained=accepted / max(rounds, 1),
            nodes=nodes / max(rounds, 1), rounds=int(rounds), forwards=forwards / max(rounds, 1),
            drafted_at=[x / max(rounds, 1) for x in drafted_at], accepted_at=[x / max(rounds, 1) for x in accepted_at],
            reading_seconds=reading / read if read else 0.0)
    bar.close()
    profile.seconds = time.perf_counter() - t0
    engine.measured_children.update(profile.children)  # the engine plans by it from now on
    path = path_of(engine, opts)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, profile.to_json())
    except OSError:
        pass  # an unwritable home: measured again next time
    return profile


def predicted(engine, profile: Profile, rows: int, prompt: int, new: int = 128) -> dict[str, float]:
    """Per child (its best draft length), and auto (the best, or 1.0: no draft), the predicted
    speedup over plain decoding of `rows` requests of `prompt` tokens each generating `new`,
    decoding together: (prefill + new forwards of `rows` rows) over (prefill + the draft's reading
    of the prompts + new / tokens per round rounds, each a forward over rows * (1 + nodes) tokens
    and its draft forwards). A chain's tokens and width at a cap are its measured rounds' by position."""
    from speclm.methods import REGISTRY

    costs = engine.forward_costs()
    draft_costs = engine.draft_costs() if engine.draft is not None else None
    prefill = rows * costs(prompt)
    plain = prefill + new * costs(rows)
    out = {}
    for name, c in profile.children.items():
        m = REGISTRY[name]
        best = 0.0
        depths = range(1, 9) if c.nodes <= 0 or not m.runs_model else [0]
        for k in depths:
            if k and c.drafted_at:  # a chain capped at k, as its rounds went position by position
                curve = c.by_position(k)
                width, tokens = sum(d for d, _ in curve), 1 + sum(a for _, a in curve)
                forwards = width * (c.forwards_per_position() or 0.0) if m.runs_model else 1
            elif k:  # a chain of k: expected tokens per round from its acceptance
                a = min(c.acceptance, 0.999)
                tokens, width, forwards = (1 - a ** (k + 1)) / (1 - a), k, k if m.runs_model else 1
            else:  # as measured (a tree, or a method whose length is its own)
                tokens, width = 1 + c.gained, max(1, round(c.nodes))
                forwards = c.forwards or 1.0  # none measured: step_seconds is per round
            step = c.step_seconds * (costs(rows) / costs(1)) if m.runs_model else c.step_seconds
            reading = rows * draft_costs(prompt) if draft_costs is not None and m.needs else 0.0
            spent = prefill + reading + new / tokens * (costs(rows * (1 + width)) + forwards * step)
            best = max(best, plain / spent)
        out[name] = best
    out["auto"] = max([1.0, *out.values()])
    return out


def show(engine, opts: GenerationOptions) -> str:
    """The stored profile and its predicted speedups, as text (UsageError where there is none)."""
    profile = load(engine, opts)
    if profile is None:
        raise UsageError(f"no profile for {key_of(engine, opts)} on this machine: run speclm tune without --show")
    lines = [f"profile {profile.key} on {profile.processor}, measured {profile.created} in {profile.seconds:.0f} s",
             f"{'method':<12}{'step ms':>9}{'acceptance':>12}{'gained/round':>14}{'nodes/round':>13}{'forwards/round':>16}"]
    for name, c in profile.children.items():
        lines.append(f"{name:<12}{c.step_seconds * 1e3:>9.2f}{c.acceptance:>12.2f}{c.gained:>14.2f}{c.nodes:>13.2f}{c.forwards:>16.2f}")
    lines.append("")
    lines.append("predicted speedup over none (128 new tokens; auto: the best, or none)")
    names = [*profile.children, "auto"]
    lines.append(f"{'prompt':<8}{'batch':>6}" + "".join(f"{n:>12}" for n in names))
    for prompt in (64, 2048):
        for rows in (1, 2, 4, 8):
            p = predicted(engine, profile, rows, prompt)
            lines.append(f"{prompt:<8}{rows:>6}" + "".join(f"{p[n]:>11.2f}x" for n in names))
    return "\n".join(lines)
