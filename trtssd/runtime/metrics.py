"""Speculation metrics, per request and in aggregate (vLLM names where they exist).

Counters are plain Python numbers updated from values the loop already has on the host, so
keeping them costs no device synchronisation.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields

from trtssd.config import Source

# Wall-clock fields: a round's time is added once to each request that took part in it, and once
# (not once per request) to the loop's aggregate.
ROUND_TIME_FIELDS = ("verify_time_s", "draft_wait_time_s", "round_time_s", "draft_answer_time_s",
                     "draft_prespec_time_s")


@dataclass
class SpeculationMetrics:
    num_drafts: int = 0  # rounds that verified a speculation
    num_draft_tokens: int = 0  # proposals verified
    num_accepted_tokens: int = 0  # proposals accepted and emitted (not those cut by a stop)
    accepted_per_position: list[int] = field(default_factory=list)
    proposed_per_position: list[int] = field(default_factory=list)
    rounds_by_length: list[int] = field(default_factory=list)  # verified rounds by proposals verified (index k-1)
    cache_hits: int = 0  # SSD rounds answered from the cache
    cache_misses: int = 0  # SSD rounds answered by a backup (sd rounds are neither)
    accepted_on_hit: int = 0
    accepted_on_miss: int = 0
    neural_backups: int = 0
    fast_backups: int = 0
    num_generated_tokens: int = 0
    verify_time_s: float = 0.0  # target forward + verification
    draft_wait_time_s: float = 0.0  # time the target waited for the draft's answer (handshake)
    round_time_s: float = 0.0  # whole speculative rounds
    draft_answer_time_s: float = 0.0  # draft rank: answering (cache lookup, or a backup on a miss)
    draft_prespec_time_s: float = 0.0  # draft rank: glue + fork + tree + populate (SSD), overlapped
    tree_branches: int = 0  # SSD: tree branches per sequence summed over rounds (auto fan-out's picks)
    degraded_rounds: int = 0  # rounds decoded in ar mode because the draft was lost
    plain_rounds: int = 0  # rounds decoded without the draft by load control (it measured faster)
    draft_cached_tokens: int = 0  # prompt tokens the draft's prefix cache gave it (not prefilled there)
    draft_prompt_tokens: int = 0  # prompt tokens looked up in the draft's prefix cache (0: the draft never reported)
    spare_row_guesses: int = 0  # plain rounds that verified an n-gram guess in a spare row
    spare_row_guesses_accepted: int = 0
    # Structured outputs: rounds that verified the grammar's forced tokens (instead of the draft's
    # proposals, or in a plain round), those tokens, the ones accepted, and the masks' seconds.
    grammar_rounds: int = 0
    grammar_proposed_tokens: int = 0
    grammar_accepted_tokens: int = 0
    grammar_mask_time_s: float = 0.0  # computing every position's mask (target side)

    def record_round(self, k: int, accepted: int, source: Source) -> None:
        """One verified round: ``accepted`` of its k proposals were accepted and emitted."""
        _add(self.rounds_by_length, [0] * (k - 1) + [1])
        _add(self.proposed_per_position, [1] * k)
        _add(self.accepted_per_position, [1] * accepted + [0] * (k - accepted))
        self.num_drafts += 1
        self.num_draft_tokens += k
        self.num_accepted_tokens += accepted
        if source is Source.HIT:
            self.cache_hits += 1
            self.accepted_on_hit += accepted
        elif source in (Source.NEURAL, Source.FAST):
            self.cache_misses += 1
            self.accepted_on_miss += accepted
            if source is Source.NEURAL:
                self.neural_backups += 1
            else:
                self.fast_backups += 1

    def record_guess(self, accepted: bool) -> None:
        """One plain round that verified an n-gram guess in its forward's spare row."""
        self.spare_row_guesses += 1
        self.spare_row_guesses_accepted += int(accepted)

    def record_grammar_round(self, proposed: int, accepted: int) -> None:
        """One row's round that verified ``proposed`` tokens the grammar forced."""
        self.grammar_rounds += 1
        self.grammar_proposed_tokens += proposed
        self.grammar_accepted_tokens += accepted

    def add_times(self, **seconds: float) -> None:
        """Add one round's wall-clock times (names from ROUND_TIME_FIELDS)."""
        for name, value in seconds.items():
            if name not in ROUND_TIME_FIELDS:
                raise ValueError(f"{name} is not a round time; allowed: {ROUND_TIME_FIELDS}")
            setattr(self, name, getattr(self, name) + value)

    def merge(self, other: "SpeculationMetrics", times: bool = True) -> None:
        """Add another's counters, and its round times unless ``times`` is False (the loop's
        aggregate adds each round's times once, not once per request in it)."""
        for f in fields(self):
            if f.name in ROUND_TIME_FIELDS and not times:
                continue
            mine, value = getattr(self, f.name), getattr(other, f.name)
            if isinstance(value, list):
                _add(mine, value)
            else:
                setattr(self, f.name, mine + value)

    def summary(self) -> dict:
        """Every counter, and the ratios read from them (0.0 where nothing was counted)."""
        out = asdict(self)
        # Tokens emitted per verified round: the accepted ones and the bonus.
        out["mean_acceptance_length"] = (round(1.0 + self.num_accepted_tokens / self.num_drafts, 4)
                                         if self.num_drafts else 0.0)
        out["cache_hit_rate"] = _ratio(self.cache_hits, self.cache_hits + self.cache_misses)
        out["acceptance_rate_per_position"] = [_ratio(a, p) for a, p in zip(self.accepted_per_position,
                                                                            self.proposed_per_position)]
        out["mean_tree_branches"] = _ratio(self.tree_branches, self.num_drafts)
        out["mean_accepted_on_hit"] = _ratio(self.accepted_on_hit, self.cache_hits)
        out["mean_accepted_on_miss"] = _ratio(self.accepted_on_miss, self.cache_misses)
        # Share of the round the target spent verifying rather than waiting for the draft.
        out["overlap_efficiency"] = _ratio(self.verify_time_s, self.round_time_s)
        return out


def _ratio(part: float, whole: float) -> float:
    return round(part / whole, 4) if whole else 0.0


def _add(counts: list[int], more: list[int]) -> None:
    """Add ``more`` into ``counts`` position by position, growing ``counts`` to its length."""
    counts += [0] * (len(more) - len(counts))
    for i, n in enumerate(more):
        counts[i] += n
