"""EAGLE: a one-layer head drafts on the target's own features, growing a dynamic tree (EAGLE-2).

The head (speclm.heads.modules.EagleHead) maps (the target's feature at token t, the embedding of
token t + 1) to a prediction of the feature at t + 1; the target's output head, restricted to the
frequent-token vocabulary, turns it into the next token's probabilities. Its own keys and values
live in a one-layer cache per row.

Each round, per row:
1. pending pairs: the target's real features for the tokens committed since the last round (the
   prompt's after the prefill, else the old root and the accepted path, which verification
   returned) with each next token, fed to the head (rows of like counts in one forward); their keys
   and values join the row's cache for good (real features never need rolling back). The last
   one's output is the predicted feature at the root, whose logits rank the root's children. A row
   it does not draft for this round (auto's other children's, lookup's) keeps its features
   pending: the planner prices feeding them as a catch-up (`unread`, `reading_seconds`);
2. levels: of the deepest level's candidates that the tree verified so far would hold (step 3),
   the `expand` of highest cumulative probability are run through the head (each from its
   parent's predicted feature and its own token, attending the cache and its ancestors); each
   gets its `branch` likeliest children; while the best of them has cumulative probability
   MIN_PROB or more (each level costs a head forward and the restricted output head);
3. the candidates of highest cumulative probability, as many as pay for their verification by this
   machine's measured forward costs (speclm.proposers.head_tree), are the draft.
The tree's own keys and values are scratch for the round: the cache holds real features only.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from speclm import defaults
from speclm.proposers.base import Draft, Verified
from speclm.proposers.head_tree import HeadProposer, Node, choose, to_draft
from speclm.tree import ROOT, lineage

# levels below the root; candidates run through the head per level; children kept per run candidate; the
# most nodes; a level grows only while its likeliest candidate has at least MIN_PROB cumulative probability
# (its children, at most that likely, would rarely repay the level's cost): speclm.defaults.TABLE
DEPTH, EXPAND, BRANCH = defaults.K_EAGLE, defaults.EAGLE_EXPAND, defaults.EAGLE_BRANCH
MAX_TREE, MIN_PROB = defaults.EAGLE_MAX_TREE, defaults.EAGLE_MIN_PROB
READ_MEASURED = 32  # a feed of fewer features is mostly fixed costs: no measure of reading one more


class EagleProposer(HeadProposer):
    name = "eagle"
    prompt_hidden = "all"

    def __init__(self, head, vocab_ids: torch.Tensor, output_head, embed, k: int = DEPTH, costs=None,
                 expand: int = EXPAND, branch: int = BRANCH):
        """head: EagleHead (eval); vocab_ids (V',); output_head: (R, E) -> (R, V'); embed: ids ->
        (..., E) fp32 (the target's embedding); k: levels below the root; costs: the target's
        ForwardCosts (None: MAX_TREE nodes)."""
        self.head, self.ids, self.output_head, self.embed = head, vocab_ids, output_head, embed
        self.k, self.costs, self.expand, self.branch = k, costs, expand, branch
        self.max_nodes = MAX_TREE
        self.device = vocab_ids.device  # the target's: its features arrive there
        c = head.config
        self.hidden_layers = c.feature_layers  # the final feature, after any fuse layers (EAGLE-3)
        self._kv_shape = (c.kv_heads, c.head_dim)
        self._seconds = 0.0
        self.start(0, 0)

    def start(self, batch_size, capacity, prompt_lengths=None, max_new_tokens=None, pool=0):
        self.keys: list[torch.Tensor] = []  # per row: (H_kv, P, D) the head's cache over real features
        self.values: list[torch.Tensor] = []
        self.pending: list[_Pending] = []  # per row: the target's states not yet fed
        self._seconds = self._prefill_seconds = 0.0
        self._read = (0.0, 0)  # (seconds, features) of catch-up feeds of READ_MEASURED or more features

    def add(self, count, prompt_lengths=None, max_new_tokens=None):
        empty = torch.zeros(*self._kv_shape[:1], 0, self._kv_shape[1], device=self.device)
        for _ in range(count):
            self.keys.append(empty)
            self.values.append(empty)
            self.pending.append(_Pending())

    @property
    def prefill_seconds(self) -> float:
        """The head's reading of features a round's drafting did not leave (a feed holding a row's
        prompt, or what was committed while the row sat out): a prefill of its own, not a round's
        drafting (the planner prices rounds without it, and that reading as a catch-up)."""
        return self._prefill_seconds

    def unread(self, contexts):
        """Per row: the features it would feed before drafting, where more than the last round's
        (its prompt's; those of rounds it sat out: auto's other children, lookup's rounds)."""
        return [p.count if k.shape[1] == 0 or len(p.chunks) > 1 else 0 for p, k in zip(self.pending, self.keys)]

    def reading_seconds(self, tokens: int) -> float | None:
        """Seconds the head takes to feed one row's `tokens` pending features: as its catch-up feeds
        of READ_MEASURED or more features measured (seconds per feature), else None."""
        seconds, fed = self._read
        return tokens * seconds / fed if fed else None

    @torch.inference_mode()
    def _real(self, hidden: dict[int, torch.Tensor]) -> torch.Tensor:
        """The head's input at real tokens from the target's states {layer: (..., E)} -> (..., E)."""
        if len(self.hidden_layers) == 1:
            return hidden[-1].float()
        return self.head.lift(torch.cat([hidden[layer].float() for layer in self.hidden_layers], -1))

    def read_prompt(self, hidden, starts):
        n = len(hidden)
        for i, (h, start) in enumerate(zip(hidden, starts)):
            self.pending[len(self.pending) - n + i] = _Pending([h], start, len(next(iter(h.values()))))

    def accept(self, verified: Verified) -> None:
        states = verified.hidden  # {layer: (B, 1 + N, E)}: the root's, then each node's
        for b, (path, keep) in enumerate(zip(verified.paths, verified.keep)):
            at = [0] + [1 + n for n in path]  # the old root's, the path's: (1 + m, E) each
            self.pending[b].add({layer: s[b, at] for layer, s in states.items()}, keep - len(path) - 1)

    def select(self, rows):
        self.keys = [self.keys[r] for r in rows]
        self.values = [self.values[r] for r in rows]
        self.pending = [self.pending[r] for r in rows]

    @torch.inference_mode()
    def propose(self, contexts, max_tokens, params, generators) -> Draft:
        t0 = time.perf_counter()
        batch = len(contexts)
        drafting = [b for b in range(batch) if max_tokens[b] > 0]  # the other rows' features wait
        unread = self.unread(contexts)
        catching_up = any(unread[b] for b in drafting)  # a prompt, or rounds sat out
        root_features, fed = self._feed_pending(contexts, drafting)  # (B, E), features fed
        if catching_up:
            seconds = time.perf_counter() - t0
            self._prefill_seconds += seconds
            if fed >= READ_MEASURED:
                self._read = (self._read[0] + seconds, self._read[1] + fed)
        depth = min(self.k, max(max_tokens, default=0))
        if depth <= 0:
            self._seconds += time.perf_counter() - t0
            return Draft.empty(batch)
        rows: list[list[Node]] = [[] for _ in range(batch)]
        feats: list[list[torch.Tensor | None]] = [[] for _ in range(batch)]  # per candidate: its predicted feature, once run
        slot: list[dict[int, int]] = [{} for _ in range(batch)]  # candidate -> its column in the round's scratch keys
        self._children(rows, [[(ROOT, 1.0)] for _ in range(batch)], root_features[:, None], feats, max_tokens, 0)
        scratch_k = scratch_v = None  # (B, H_kv, S, D) the run candidates' keys and values
        forwards = 1
        for level in range(1, depth):
            picks = []
            for b in range(batch):  # a candidate the tree would leave out: its children would be left out too
                verified = choose(rows[b], min(depth, max_tokens[b]), self.costs, self.max_nodes)
                frontier = [i for i in verified if rows[b][i].depth == level - 1 and level < max_tokens[b]]
                frontier.sort(key=lambda i: -rows[b][i].cum)
                picks.append(frontier[: self.expand])
            if not any(picks) or max(rows[b][p[0]].cum for b, p in enumerate(picks) if p) < MIN_PROB:
                break
            width = max(len(p) for p in picks)
            predicted, k, v = self._run(contexts, rows, feats, slot, picks, width, scratch_k, scratch_v, root_features)
            forwards += 1
            base = 0 if scratch_k is None else scratch_k.shape[2]
            scratch_k = k if scratch_k is None else torch.cat([scratch_k, k], 2)
            scratch_v = v if scratch_v is None else torch.cat([scratch_v, v], 2)
            parents = []
            for b, p in enumerate(picks):
                for col, i in enumerate(p):
                    slot[b][i] = base + col
                    feats[b][i] = predicted[b, col]
                parents.append([(i, rows[b][i].cum) for i in p])
            self._children(rows, parents, predicted, feats, max_tokens, level)
        chosen = [choose(nodes, min(depth, max_tokens[b]), self.costs, self.max_nodes) for b, nodes in enumerate(rows)]
        self._seconds += time.perf_counter() - t0
        return to_draft(rows, chosen, forwards)

    def _feed_pending(self, contexts: list[list[int]], drafting: list[int]) -> tuple[torch.Tensor, int]:
        """Step 1: the pending real features of the rows in `drafting` through the head; their keys
        and values join the cache. Returns each row's predicted feature at its root (B, E; zeros for
        the rows not drafting) and the features fed. Rows of like counts are fed together (a row
        with a prompt to read would pad every other row to its length)."""
        size = self.head.config.hidden_size
        roots = torch.zeros(len(contexts), size, device=self.device)
        counts = {b: self.pending[b].count for b in drafting}
        assert min(counts.values(), default=1) >= 1, "a row proposes before its prompt's features arrived"
        for group in _packed(sorted(drafting, key=lambda b: counts[b]), counts):
            roots[group] = self._feed(contexts, group, [counts[b] for b in group])
        return roots, sum(counts.values())

    def _feed(self, contexts: list[list[int]], group: list[int], counts: list[int]) -> torch.Tensor:
        """Rows `group`'s pending features (counts: theirs) through the head in one forward; their
        predicted features at their roots (G, E)."""
        batch, width, size = len(group), max(counts), self.head.config.hidden_size
        features = torch.zeros(batch, width, size, device=self.device)
        tokens = torch.zeros(batch, width, dtype=torch.long)
        positions = torch.zeros(batch, width, dtype=torch.long)
        for i, (b, m) in enumerate(zip(group, counts)):
            p = self.pending[b]
            j = p.first
            features[i, :m] = self._real(p.states())
            tokens[i, :m] = torch.tensor(contexts[b][j + 1 : j + 1 + m], dtype=torch.long)
            positions[i, :m] = torch.arange(j + 1, j + 1 + m)
        past_k, past_v, past_len = self._past(0, group)
        longest = past_k.shape[2]
        mask = torch.zeros(batch, width, longest + width, dtype=torch.bool)
        mask[:, :, longest:] = torch.ones(width, width, dtype=torch.bool).tril()
        for i, n in enumerate(past_len):
            mask[i, :, :n] = True
        positions, mask = positions.to(self.device), mask.to(self.device)
        out, k, v = self.head(features, self.embed(tokens), positions, (past_k, past_v), mask)
        for i, (b, m) in enumerate(zip(group, counts)):
            self.keys[b] = torch.cat([self.keys[b], k[i, :, :m]], 1)
            self.values[b] = torch.cat([self.values[b], v[i, :, :m]], 1)
            self.pending[b] = _Pending()
        return out[torch.arange(batch), torch.tensor(counts) - 1]

    def _past(self, extra: int, rows: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        """The cached keys and values of `rows` (None: every row), padded to the longest, with
        `extra` zero columns after them (the round's scratch); (B, H_kv, P + extra, D) each, and
        each row's length."""
        rows = range(len(self.keys)) if rows is None else rows
        past_len = [self.keys[b].shape[1] for b in rows]
        past_k = torch.zeros(len(past_len), self._kv_shape[0], max(past_len) + extra, self._kv_shape[1],
                             device=self.device)
        past_v = torch.zeros_like(past_k)
        for i, (b, n) in enumerate(zip(rows, past_len)):
            past_k[i, :, :n], past_v[i, :, :n] = self.keys[b], self.values[b]
        return past_k, past_v, past_len

    def _run(self, contexts, rows, feats, slot, picks, width, scratch_k, scratch_v, root_features):
        """Run each row's picked candidates through the head: (their parents' predicted feature,
        their token), at the position of their depth, attending the row's cache, their run
        ancestors' scratch keys and themselves. Returns predicted features (B, W, E) and keys and
        values (B, H_kv, W, D)."""
        batch = len(rows)
        size = self.head.config.hidden_size
        features = torch.zeros(batch, width, size, device=self.device)
        tokens = torch.zeros(batch, width, dtype=torch.long)
        positions = torch.zeros(batch, width, dtype=torch.long)
        scratch = 0 if scratch_k is None else scratch_k.shape[2]
        past_k, past_v, past_len = self._past(scratch)
        longest = past_k.shape[2] - scratch
        mask = torch.zeros(batch, width, longest + scratch + width, dtype=torch.bool)
        for b, p in enumerate(picks):
            mask[b, :, :past_len[b]] = True
            for col, i in enumerate(p):
                node = rows[b][i]
                parent = node.parent
                features[b, col] = root_features[b] if parent == ROOT else feats[b][parent]
                tokens[b, col] = node.token
                positions[b, col] = len(contexts[b]) + node.depth
                for at in lineage(parent, lambda n: rows[b][n].parent)[0]:  # its ancestors' scratch columns
                    mask[b, col, longest + slot[b][at]] = True
                mask[b, col, longest + scratch + col] = True
            for col in range(len(p), width):  # padding queries see themselves (no empty softmax)
                mask[b, col, longest + scratch + col] = True
        if scratch:
            past_k[:, :, longest:], past_v[:, :, longest:] = scratch_k, scratch_v
        positions, mask = positions.to(self.device), mask.to(self.device)
        return self.head(features, self.embed(tokens), positions, (past_k, past_v), mask)

    def _children(self, rows, parents, features, feats, max_tokens, level) -> None:
        """Each parent's `branch` likeliest children at depth `level`, from the predicted features
        (B, W, E) of the parents in `parents` (per row, (candidate or ROOT, its cumulative probability))."""
        batch, width = len(rows), features.shape[1]
        logits = self.output_head(features.reshape(batch * width, -1)).float()
        probs = torch.softmax(logits, -1).view(batch, width, -1)
        top_p, top_i = probs.topk(min(self.branch, probs.shape[-1]), dim=-1)
        tokens = self.ids[top_i].tolist()
        top_p = top_p.tolist()
        for b in range(batch):
            if level >= max_tokens[b]:
                continue
            for col, (parent, cum) in enumerate(parents[b]):
                for t, q in zip(tokens[b][col], top_p[b][col]):
                    rows[b].append(Node(t, parent, level, cum * q))
                    feats[b].append(None)


def _packed(rows: list[int], counts: dict[int, int]) -> list[list[int]]:
    """Rows (ascending by count) in groups fed together: a group grows while its padded size (its
    rows times its largest count) stays within twice its features, so a row with a prompt to read
    is fed apart from rows with a round's few."""
    groups: list[list[int]] = []
    for b in rows:
        if groups and (len(groups[-1]) + 1) * counts[b] <= 2 * (sum(counts[r] for r in groups[-1]) + counts[b]):
            groups[-1].append(b)
        else:
            groups.append([b])
    return groups


@dataclass
class _Pending:
    """One row's target states not yet fed to the head: chunks of {layer: (m_i, E)} (the prompt's,
    then each round's old root and accepted path: one a round, so more than one after a feed means
    rounds sat out), the first one's index in the context, and how many. Joined and lifted to the
    head's input when fed (a round appends, never copies the rest)."""

    chunks: list[dict[int, torch.Tensor]] = field(default_factory=list)
    first: int = 0
    count: int = 0

    def add(self, states: dict[int, torch.Tensor], first: int) -> None:
        if not self.chunks:
            self.first = first
        self.chunks.append(states)
        self.count += len(next(iter(states.values())))

    def states(self) -> dict[int, torch.Tensor]:
        return {layer: torch.cat([c[layer] for c in self.chunks]) for layer in self.chunks[0]}

