"""Per-request statistics. The field names are a contract shared with the CLI's JSON output."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class RequestStats:
    target_forwards: int = 0  # target forwards this request took part in, prefill included
    draft_forwards: int = 0  # draft model forwards, or trained heads' (0 for pld and none)
    drafted_tokens: int = 0  # tokens proposed and sent to verification
    accepted_tokens: int = 0  # drafted tokens the verifier accepted
    accepted_per_position: list[int] = field(default_factory=list)  # [j]: rounds that accepted a token at depth j
    drafted_per_position: list[int] = field(default_factory=list)  # [j]: rounds whose draft reached depth j
    verified_nodes: int = 0  # draft tokens the target scored (a tree's every node, a chain's alternatives too)
    alternatives: int = 0  # second candidates verified beside drafted tokens (a tree's leaves; not in drafted_tokens)
    accepted_alternatives: int = 0  # of those, accepted (counted in accepted_tokens too)
    draft_seconds: float = 0.0  # time proposing (shared batch time while the row was active)
    draft_prefill_seconds: float = 0.0  # of draft_seconds: reading the prompt and rounds it sat out (the draft model's forwards; EAGLE: its head's)
    verify_seconds: float = 0.0  # time in target forwards and verification, prefill included
    wall_seconds: float = 0.0  # from the start of the request to its last token
    forward_seconds: float = 0.0  # inside target and draft model forwards (shared batch time)
    prefill_seconds: float = 0.0  # the first round: the prompt's forward, which commits the first token
    constraint_seconds: float = 0.0  # computing the constraint's token masks (speclm.constraint), along every draft
    cached_tokens: int = 0  # prompt tokens whose keys and values the target took from the prefix cache
    new_tokens: int = 0  # generated tokens returned (EOS included when generated)
    # counted by the proposers that declare them (Proposer.round_counts):
    lookup_rounds: int = 0  # `+pld` methods: rounds prompt lookup drafted this request's row
    pool_hits: int = 0  # lookahead: rounds whose verification branch held a pooled n-gram
    pool_tokens: int = 0  # lookahead: accepted tokens of pooled n-grams (per hit: the accepted n-gram length)
    round_trips: int = 0  # --verifier: rounds sent to the remote verifier (target_forwards: the server's)
    round_trip_seconds: float = 0.0  # --verifier: their time, from sending a draft to reading the reply
    resumed_sessions: int = 0  # --verifier: sessions started again (a dropped connection, a restarted server)
    planned: dict[str, int] = field(default_factory=dict)  # auto: rounds each child drafted ("none": no draft)
    plan_switches: list[str] = field(default_factory=list)  # auto: the planner's last 16 moves between children, and why

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0

    @property
    def mean_accepted_tokens(self) -> float:
        """Tokens committed per target forward, the recovered or bonus token included (plain decoding: 1.0)."""
        return self.new_tokens / self.target_forwards if self.target_forwards else 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.wall_seconds if self.wall_seconds > 0 else 0.0

    @property
    def decode_tokens_per_second(self) -> float:
        """Tokens after the first, over the time after the prefill: what speculation speeds up."""
        decode = self.wall_seconds - self.prefill_seconds
        return (self.new_tokens - 1) / decode if self.new_tokens > 1 and decode > 0 else 0.0

    @property
    def overhead_share(self) -> float:
        """Share of wall time spent outside model forwards: the engine's own cost."""
        return max(0.0, 1.0 - self.forward_seconds / self.wall_seconds) if self.wall_seconds > 0 else 0.0

    def to_dict(self) -> dict:
        d = asdict(self)
        d["acceptance_rate"] = self.acceptance_rate
        d["mean_accepted_tokens"] = self.mean_accepted_tokens
        d["tokens_per_second"] = self.tokens_per_second
        d["overhead_share"] = self.overhead_share
        d["decode_tokens_per_second"] = self.decode_tokens_per_second
        return d

    def add_counts(self, counts: dict[str, int]) -> None:
        """A proposer's counters for one round (Proposer.round_counts), added by field name."""
        for name, value in counts.items():
            if isinstance(value, dict):  # counts by name (auto's rounds per child)
                into = getattr(self, name)
                for k, v in value.items():
                    into[k] = into.get(k, 0) + v
            else:
                setattr(self, name, getattr(self, name) + value)  # AttributeError: a proposer counting no field

    def record_acceptance(self, drafted: int, accepted: int, depth: int | None = None) -> None:
        """One round: `drafted` tokens proposed (a tree's nodes), `accepted` of them on the path,
        the draft `depth` deep (a chain: drafted)."""
        self.drafted_tokens += drafted
        self.accepted_tokens += accepted
        depth = drafted if depth is None else depth
        for counts in (self.accepted_per_position, self.drafted_per_position):
            counts.extend([0] * (depth - len(counts)))
        for j in range(depth):
            self.drafted_per_position[j] += 1
        for j in range(accepted):
            self.accepted_per_position[j] += 1
