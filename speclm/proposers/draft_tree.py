"""A draft model's tree: several candidates per position, grown level by level, one draft forward
per level, all verified in one target forward (speclm.tree, speclm.round.verify.verify_tree).

Two shapes:
- static (`--tree FILE`): a JSON list of root paths of ranks, Medusa's "choices" format: [[0], [1],
  [0, 0]] is the draft's first and second choice after the last committed token, and its first
  choice after the first. Every listed path's prefixes must be listed too.
- auto (`--tree auto`), as EAGLE-2 grows its trees: at each level the `expand` nodes of highest
  cumulative draft probability (the product of the draft's probabilities along the path: the
  draft's estimate that the target accepts the whole path) each get their `branch` likeliest
  children, up to `depth` levels, while some node is worth expanding (cumulative probability at
  least `min_prob`). Greedy decoding then keeps the nodes of highest cumulative probability, as
  many as pay for themselves: N maximising (1 + their summed probability) / (drafting time +
  the target's measured forward time over N + 1 tokens, speclm.forward.costs).

Sampling stays exact: a node's children are its distribution's draws without replacement (rank
r: the r-th draw, carrying the distribution it was drawn from), and whether a node gets children,
and how many, is decided before they are drawn, from what was drawn earlier and from the
distribution itself; every drawn node is verified (a choice among drawn nodes by their own
probability would bias them). With the cost lines set (`costs`, `draft_costs`: measured once per
model, so a row's tree does not depend on timings or on its batch), a sampled auto
tree is sized as it grows: a node's children count is the one maximising expected tokens per
second, the chance that the target's token is among c draws estimated from the distribution as
sum_x q(x) (1 - (1 - q(x))^c); a level is expanded where the expected gain pays for a draft
forward and the wider verification. Greedy: rank r is the r-th likeliest token.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from speclm import defaults
from speclm.errors import UsageError
from speclm.forward.costs import StepTimes
from speclm.proposers.draft_vocab import on_vocabulary, token_of
from speclm.sampling import SamplingParams, processed_probs, sample
from speclm.tree import PAD, ROOT

MAX_NODES = 64  # the most nodes a tree may hold (the KV caches' headroom)


@dataclass(frozen=True)
class TreeSpec:
    choices: tuple[tuple[int, ...], ...] | None = None  # static tree; None: auto
    depth: int = defaults.TREE_DEPTH  # auto: levels below the root
    branch: int = defaults.TREE_BRANCH  # auto: children per expanded node
    expand: int = defaults.TREE_EXPAND  # auto: nodes expanded per level
    min_prob: float = defaults.TREE_MIN_PROB  # auto: a node below this cumulative probability is not expanded
    follow: float = defaults.TREE_FOLLOW  # auto, greedy: a level's likeliest node is expanded where the draft gave it this much
    costs: Callable[[int], float] | None = field(default=None, compare=False)  # tokens -> seconds (target forward)
    draft_costs: Callable[[int], float] | None = field(default=None, compare=False)  # the same, the draft's (sampling)

    @property
    def max_depth(self) -> int:
        return max(map(len, self.choices)) if self.choices else self.depth

    @property
    def max_nodes(self) -> int:
        if self.choices:
            return len(self.choices)
        return min(MAX_NODES, self.branch + (self.depth - 1) * self.expand * self.branch)


def parse_tree(value: str | None) -> TreeSpec | None:
    """`chain` (or None) -> None; `auto` -> TreeSpec(); a file -> its static tree. UsageError for anything else."""
    if value is None or value == "chain":
        return None
    if value == "auto":
        return TreeSpec()
    path = Path(value)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"--tree: '{value}' is neither chain, auto nor a readable JSON file "
                         f"({getattr(exc, 'strerror', None) or exc})") from None
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise UsageError(f"--tree {value}: not JSON ({exc})") from None
    return TreeSpec(choices=check_choices(data, str(value)))


def check_choices(data, where: str = "tree") -> tuple[tuple[int, ...], ...]:
    """A static tree's root paths, checked: a non-empty list of distinct non-empty lists of ranks
    >= 0, each path's prefixes listed, at most MAX_NODES paths. Ordered by depth, then as given."""
    if not isinstance(data, list) or not data:
        raise UsageError(f"{where}: a tree is a non-empty JSON list of root paths of ranks, such as [[0], [1], [0, 0]]")
    paths = []
    for p in data:
        if not isinstance(p, list) or not p or not all(isinstance(r, int) and not isinstance(r, bool) and r >= 0 for r in p):
            raise UsageError(f"{where}: {json.dumps(p)} is not a non-empty list of ranks >= 0")
        paths.append(tuple(p))
    if len(set(paths)) != len(paths):
        raise UsageError(f"{where}: a path is listed twice")
    if len(paths) > MAX_NODES:
        raise UsageError(f"{where}: {len(paths)} nodes; at most {MAX_NODES}")
    listed = set(paths)
    for p in paths:
        if len(p) > 1 and p[:-1] not in listed:
            raise UsageError(f"{where}: {list(p)} is listed but its parent {list(p[:-1])} is not")
    return tuple(sorted(paths, key=len))


RANKS, BINS = 8, 10  # acceptance is measured by a node's rank and its draft probability (tenths)


@dataclass
class DraftTimes:
    """A proposer's running measurements, for growing greedy auto trees by cost: what its draft
    forwards took by tokens fed per row; how often the target accepted a node it tested (its
    parent accepted), by the node's rank among its siblings and the draft's probability of it;
    and the mean acceptance so measured of a node's likeliest child."""
    steps: StepTimes = field(default_factory=StepTimes)  # draft forwards by tokens fed per row
    top: float = 0.6
    # (RANKS, BINS) counts, starting as if 2 tries had accepted as often as the draft's probability
    hits: list[list[float]] = field(default_factory=lambda: [[0.2 * b + 0.1 for b in range(BINS)] for _ in range(RANKS)])
    tries: list[list[float]] = field(default_factory=lambda: [[2.0] * BINS for _ in range(RANKS)])

    @staticmethod
    def _cell(prob: float, rank: int) -> tuple[int, int]:
        return min(rank, RANKS - 1), min(int(prob * BINS), BINS - 1)

    def acceptance(self, prob: float, rank: int) -> float:
        """P(the target accepts a node | it tests it), measured, for a node of this rank and draft probability."""
        r, b = self._cell(prob, rank)
        return self.hits[r][b] / self.tries[r][b]

    def tested(self, prob: float, rank: int, accepted: bool) -> None:
        r, b = self._cell(prob, rank)
        self.tries[r][b] += 1
        self.hits[r][b] += accepted


@dataclass
class _Node:
    token: int  # token id
    parent: int  # index of the parent node in its row, or ROOT
    depth: int
    ranks: tuple[int, ...]  # its root path of ranks
    prob: float  # its path's value: the product of each node's expected acceptance (else draft probability)
    q: torch.Tensor | None  # (V,) the distribution it was drawn from (sampling)
    slot: int | None = None  # where the draft fed it, if it did
    local: float = 1.0  # the draft's probability of its token after its parent


@dataclass
class GrownTree:
    tokens: torch.Tensor  # (B, N)
    parents: torch.Tensor  # (B, N)
    lengths: torch.Tensor  # (B,)
    probs: torch.Tensor | None  # (B, N, V)
    slots: list[list[int | None]]  # per row and node: the draft cache slot it was fed at
    forwards: int
    nodes: list[list[_Node]]  # per row, its nodes as verified (for measuring acceptance)


def grow(kv, vocabs, rows: list[int], vocab_size: int, spec: TreeSpec, root_logits: torch.Tensor, lengths: list[int],
         budgets: list[int], params: SamplingParams, generators: list, began: float,
         times: DraftTimes | None = None, only: list[int] | None = None, guides: list | None = None) -> GrownTree:
    """Grow a tree for each of the draft's batch rows `rows` from the draft's logits after its last
    committed token, root_logits (B, S) over its head's columns (vocabs: each row's own columns and
    their token ids, speclm.proposers.draft_vocab.RowVocabs). kv: the draft's StaticKV, holding
    lengths[i] tokens of row rows[i] (only: rows to feed, None: all of kv's); budgets: each row's
    deepest path; began: when this round's drafting began; times: the proposer's measurements
    (greedy auto trees of one row then expand a level only while the cost model expects it to pay);
    guides: per row, a constrained request's parser (speclm.constraint.Matcher) or None: a node's
    children are drawn from the distribution its constraint leaves after the node's path."""
    batch = root_logits.shape[0]
    head = vocabs.head
    by_cost = (spec.choices is None and params.greedy and spec.costs is not None and times is not None
               and batch == 1)
    sized = spec.choices is None and not params.greedy and spec.costs is not None and spec.draft_costs is not None
    plans = [_Plan(spent=spec.draft_costs(1)) for _ in range(batch)] if sized else None
    nodes: list[list[_Node]] = [[] for _ in range(batch)]
    limit = [min(spec.max_depth, max(b, 0)) for b in budgets]
    # per row: (parent node or ROOT, its logits (S,)) to draw children from at this level
    frontier = [[(ROOT, root_logits[b])] if limit[b] > 0 else [] for b in range(batch)]
    forwards = 0
    for depth in range(spec.max_depth):
        grown = [[] for _ in range(batch)]  # per row: this level's new node indices
        for b in range(batch):
            scores = [vocabs.logits(rows[b], logits) for _, logits in frontier[b]]
            blocked: set[int] = set()  # frontier entries whose constraint allows nothing of the draft's columns
            if guides is not None and guides[b] is not None:
                for i, (parent, _) in enumerate(frontier[b]):
                    allowed = _allowed_after(guides[b], _path(nodes[b], parent), vocabs, rows[b], head, scores[i].shape[-1])
                    if allowed is None:
                        blocked.add(i)
                    else:
                        scores[i] = scores[i].masked_fill(~allowed.to(scores[i].device), float("-inf"))
            dists = [processed_probs(x, params) for x in scores] if sized else [None] * len(scores)  # (S,) each
            if sized:
                counts = _sampled_counts(spec, plans[b], [nodes[b][n].prob if n != ROOT else 1.0 for n, _ in frontier[b]],
                                         dists)
            for i, (parent, _) in enumerate(frontier[b]):
                if i in blocked:
                    continue
                ranks = list(range(counts[i])) if sized else _ranks_wanted(spec, nodes[b], parent)
                for rank, token, p, q in _children(scores[i], ranks, params, generators[b],
                                                   vocabs.token_ids(rows[b]), vocab_size, probs=dists[i]):
                    value = times.acceptance(p, rank) if by_cost else p
                    if rank == 0 and by_cost:
                        times.top = 0.9 * times.top + 0.1 * value
                    up = nodes[b][parent] if parent != ROOT else None
                    nodes[b].append(_Node(token, parent, depth, (up.ranks if up else ()) + (rank,),
                                          (up.prob if up else 1.0) * value, q, local=p))
                    grown[b].append(len(nodes[b]) - 1)
                    if sized:
                        plans[b].gain += nodes[b][-1].prob
            if sized:
                plans[b].nodes = len(nodes[b])
        if depth + 1 >= spec.max_depth:
            break
        if by_cost:
            chosen = [_expand_by_cost(spec, nodes[0], grown[0], times, time.perf_counter() - began)
                      if depth + 1 < limit[0] else []]
        elif sized:
            chosen = [_expand_sampled(spec, plans[b], nodes[b], grown[b]) if depth + 1 < limit[b] else []
                      for b in range(batch)]
        else:
            chosen = [_to_expand(spec, nodes[b], grown[b]) if depth + 1 < limit[b] else [] for b in range(batch)]
        width = max(map(len, chosen))
        if width == 0:
            break
        feed, parents = [], []
        for b in range(batch):
            row = [nodes[b][n] for n in chosen[b]]
            start = lengths[b]  # kv's length for the row before this forward
            feed.append([n.token for n in row] + [0] * (width - len(row)))  # padding continues as a chain
            parents.append([lengths[b] - 1 if n.parent == ROOT else nodes[b][n.parent].slot for n in row]
                           + [-1] * (width - len(row)))
            for i, n in enumerate(row):
                n.slot = start + i
        t0 = time.perf_counter()
        logits = kv.forward(feed, width, head, parents=parents, only=only)  # (B, width, S)
        if times is not None:
            times.steps.record(width, time.perf_counter() - t0)
        lengths = [length + width for length in lengths]
        forwards += 1
        frontier = [[(n, logits[b, i]) for i, n in enumerate(chosen[b])] for b in range(batch)]
    if spec.choices is None and params.greedy and spec.costs is not None:
        spent = time.perf_counter() - began
        nodes = [_best(row, spec.costs, spent) for row in nodes]
    return _tensors(nodes, vocab_size, forwards, with_probs=not params.greedy)


def _path(nodes: list[_Node], node: int) -> list[int]:
    """The tokens from the root down to `node` (ROOT: none)."""
    out = []
    while node != ROOT:
        out.append(nodes[node].token)
        node = nodes[node].parent
    return out[::-1]


def _allowed_after(guide, path: list[int], vocabs, row: int, head, width: int) -> torch.Tensor | None:
    """(S_row,) bool: the row's draft columns its constraint allows after `path`; None where the
    path ends the output (an end of sequence) or the constraint allows none of them."""
    pushed = 0
    try:
        for t in path:
            if not guide.push(t):
                return None
            pushed += 1
        columns = guide.allowed(width, head.ids if head is not None else None)  # over the head's columns
    finally:
        guide.pop(pushed)
    allowed = vocabs.logits(row, columns)
    return allowed if bool(allowed.any()) else None


def _ranks_wanted(spec: TreeSpec, nodes: list[_Node], parent: int) -> list[int]:
    """Which ranks of children `parent` gets (ascending)."""
    if spec.choices is None:
        return list(range(spec.branch))
    prefix = nodes[parent].ranks if parent != ROOT else ()
    return sorted(p[-1] for p in spec.choices if len(p) == len(prefix) + 1 and p[:-1] == prefix)


def _to_expand(spec: TreeSpec, nodes: list[_Node], grown: list[int]) -> list[int]:
    """This level's nodes that get children at the next one, in node order."""
    if spec.choices is not None:
        parents = {p[:-1] for p in spec.choices}
        return [n for n in grown if nodes[n].ranks in parents]
    worth = [n for n in grown if nodes[n].prob >= spec.min_prob]
    best = sorted(worth, key=lambda n: -nodes[n].prob)[: spec.expand]
    return sorted(best)


def _children(logits: torch.Tensor, ranks: list[int], params: SamplingParams, generator, ids: torch.Tensor | None,
              vocab_size: int, probs: torch.Tensor | None = None):
    """(rank, token id, draft probability, distribution drawn from (V,) or None) for each wanted rank;
    logits (S,) over token ids `ids` (None: all V); probs: their processed distribution where the
    caller has it already (sampling)."""
    if not ranks:
        return []
    if params.greedy:
        probs = torch.softmax(logits.float(), -1)
        top = torch.topk(probs, min(max(ranks) + 1, probs.shape[-1]))
        picked = [(r, int(top.indices[r]), float(top.values[r])) for r in ranks
                  if r < len(top.indices) and float(top.values[r]) > 0]  # none a constraint forbids
        return [(r, token_of(ids, i), p, None) for r, i, p in picked]
    q = (probs if probs is not None else processed_probs(logits, params)).cpu()  # (S,)
    out, wanted = [], set(ranks)
    left = q.clone()
    for r in range(max(ranks) + 1):
        if float(left.sum()) <= 0:
            break  # fewer tokens than ranks
        dist = left / left.sum()
        i = sample(dist, generator)
        if r in wanted:
            out.append((r, token_of(ids, i), float(q[i]), on_vocabulary(dist, ids, vocab_size)))
        left[i] = 0.0  # the next rank is drawn without it
    return out


@dataclass
class _Plan:
    """A sampled auto tree's row as it grows: the estimated drafting seconds so far (from the draft's
    cost line), the nodes drawn, their summed values (the expected accepted tokens) and the one-draw
    coverage of each distribution drawn from."""
    spent: float
    nodes: int = 0
    gain: float = 0.0
    cover: list[float] = field(default_factory=list)


def coverage(q: torch.Tensor, draws: int) -> list[float]:
    """For c = 1..draws: the chance that a token drawn from q is among c draws from q, an estimate
    of the chance that the target's token is (with replacement: a lower bound of the draws without
    replacement that a tree makes). q (S,)."""
    q = q.float()
    return [float((q * (1 - (1 - q) ** c)).sum()) for c in range(1, draws + 1)]


def _sampled_counts(spec: TreeSpec, plan: _Plan, values: list[float], dists: list[torch.Tensor]) -> list[int]:
    """How many children each of a level's expanded nodes (values: their paths' values; dists:
    the distributions their children are drawn from) gets, before any is drawn: at least one (its
    draft forward is paid for), more while the expected gain of another draw pays for one more
    verified token. The gains of a node's draws shrink (coverage is concave), so the best prefix
    of all draws sorted by gain is the best choice."""
    counts, extra = [], []  # extra: (gain, node) of each draw after a node's first
    for i, (value, q) in enumerate(zip(values, dists)):
        cover = coverage(q, spec.branch)
        plan.cover.append(cover[0])
        counts.append(1)
        extra += [(value * (cover[c] - cover[c - 1]), i) for c in range(1, len(cover))]
    extra.sort(key=lambda e: -e[0])
    room = max(0, MAX_NODES - plan.nodes - len(values))
    drawn = plan.nodes + len(values)
    gain = 1.0 + plan.gain + sum(v * q for v, q in zip(values, plan.cover[-len(values):]))
    best, best_rate = 0, gain / (plan.spent + spec.costs(drawn + 1))
    for j, (g, _) in enumerate(extra[:room], 1):
        gain += g
        rate = gain / (plan.spent + spec.costs(drawn + j + 1))
        if rate > best_rate:
            best, best_rate = j, rate
    for _, i in extra[:best]:
        counts[i] += 1
    return counts


def _expand_sampled(spec: TreeSpec, plan: _Plan, nodes: list[_Node], grown: list[int]) -> list[int]:
    """Which of this level's drawn nodes a sampled auto tree expands: the w of highest value, w the
    one whose expected rate is best, each expected to add a child of its value times the mean
    one-draw coverage so far, for a draft forward over w tokens and w more verified tokens. At least
    the likeliest where the draft gave its token `follow` or more (as in greedy trees)."""
    candidates = sorted(grown, key=lambda n: -nodes[n].prob)[: max(0, min(spec.expand, MAX_NODES - plan.nodes))]
    kappa = sum(plan.cover) / len(plan.cover) if plan.cover else 0.0
    best, best_rate = [], (1.0 + plan.gain) / (plan.spent + spec.costs(plan.nodes + 1))
    if candidates and nodes[candidates[0]].local >= spec.follow:
        best, best_rate = candidates[:1], 0.0
    for w in range(1, len(candidates) + 1):
        added = kappa * sum(nodes[n].prob for n in candidates[:w])
        rate = (1.0 + plan.gain + added) / (plan.spent + spec.draft_costs(w) + spec.costs(plan.nodes + w + 1))
        if rate > best_rate:
            best, best_rate = candidates[:w], rate
    if best:
        plan.spent += spec.draft_costs(len(best))
    return sorted(best)


def _best_rate(probs: list[float], costs: Callable[[int], float], spent: float) -> float:
    """The most expected tokens per second a round can reach verifying some of these nodes (the
    likeliest first): max over N of (1 + their probabilities) / (spent + a forward over N + 1)."""
    gain, best = 1.0, 1.0 / (spent + costs(1))
    for count, p in enumerate(sorted(probs, reverse=True), 1):
        gain += p
        best = max(best, gain / (spent + costs(count + 1)))
    return best


def _expand_by_cost(spec: TreeSpec, nodes: list[_Node], grown: list[int], times: DraftTimes, spent: float) -> list[int]:
    """The w likeliest of this level's nodes to expand, w (0 to spec.expand) the one whose
    expected rate is best: each expanded node is expected to add a child of its value times the
    measured acceptance of a likeliest child, at the cost of one draft forward over w tokens.
    At least the likeliest where the draft gave it `follow` or more (the rate of one level ahead
    undervalues the levels after it; a confident draft's next token is likely accepted too)."""
    probs = [n.prob for n in nodes]
    best, best_rate = [], _best_rate(probs, spec.costs, spent)
    candidates = sorted(grown, key=lambda n: -nodes[n].prob)[: spec.expand]
    if candidates and nodes[candidates[0]].local >= spec.follow:  # as a chain's confidence rule: go on
        best, best_rate = candidates[:1], 0.0
    for w in range(1, len(candidates) + 1):
        step = times.steps.at(w, spec.costs)
        if step is None:  # nothing measured yet: EAGLE-2's rule
            return sorted(n for n in candidates if nodes[n].prob >= spec.min_prob)
        extra = [nodes[n].prob * times.top for n in candidates[:w]]
        rate = _best_rate(probs + extra, spec.costs, spent + step)
        if rate > best_rate:
            best, best_rate = candidates[:w], rate
    return sorted(best)


def _best(nodes: list[_Node], costs: Callable[[int], float], spent: float) -> list[_Node]:
    """Greedy auto trees: the nodes of highest cumulative probability (a parent before its
    children), as many as maximise expected tokens per second of the round."""
    if not nodes:
        return nodes
    order = sorted(range(len(nodes)), key=lambda n: (-nodes[n].prob, n))
    gain, best, best_rate = 1.0, 0, 1.0 / (spent + costs(1))
    for count, n in enumerate(order, 1):
        gain += nodes[n].prob
        rate = gain / (spent + costs(count + 1))
        if rate > best_rate:
            best, best_rate = count, rate
    keep = sorted(order[:best])
    kept = set(keep)
    while True:  # a kept node's parent is kept (ties in probability aside, it is already)
        missing = {nodes[n].parent for n in keep if nodes[n].parent != ROOT and nodes[n].parent not in kept}
        if not missing:
            break
        kept |= missing
        keep = sorted(kept)
    index = {old: new for new, old in enumerate(keep)}
    out = []
    for old in keep:
        n = nodes[old]
        out.append(_Node(n.token, ROOT if n.parent == ROOT else index[n.parent], n.depth, n.ranks, n.prob, n.q, n.slot,
                         n.local))
    return out


def _tensors(nodes: list[list[_Node]], vocab_size: int, forwards: int, with_probs: bool) -> GrownTree:
    batch = len(nodes)
    width = max((len(r) for r in nodes), default=0)
    tokens = torch.zeros(batch, width, dtype=torch.long)
    parents = torch.full((batch, width), PAD, dtype=torch.long)
    probs = torch.zeros(batch, width, vocab_size) if with_probs and width else None
    for b, row in enumerate(nodes):
        for i, n in enumerate(row):
            tokens[b, i], parents[b, i] = n.token, n.parent
            if probs is not None:
                probs[b, i] = n.q
    lengths = torch.tensor([len(r) for r in nodes], dtype=torch.long)
    return GrownTree(tokens, parents, lengths, probs, [[n.slot for n in row] for row in nodes], forwards, nodes)


def record_acceptance(times: DraftTimes, nodes: list[_Node], path: list[int]) -> None:
    """Count, for each node the target tested (a child of the root or of an accepted node),
    whether it was accepted."""
    on_path = set(path)
    for i, n in enumerate(nodes):
        if n.parent == ROOT or n.parent in on_path:
            times.tested(n.local, n.ranks[-1], i in on_path)
