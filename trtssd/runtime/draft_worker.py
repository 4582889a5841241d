"""The draft rank's work, free of any transport: answer -> glue -> fork -> tree -> populate.

`answer` turns the target's verification outcomes into the next speculation (from the cache on a
hit, from a backup speculator on a miss). In SSD mode `prespeculate` then runs while the target
verifies: glue-decode the speculation just returned, fork on the likely bonus tokens, tree-decode
every fork in one batched forward per step, and populate the cache for the next round.

Every proposal is sampled from a known distribution that travels with it (Saguaro q', built by
`trtssd.spec_decode.saguaro.saguaro_probs` from the draft's processed distribution), or is
deterministic and marked as a point mass, so the target's verification is exact either way.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch

from trtssd.backends.base import Executor, chain_chunk
from trtssd.config import Backup, Mode, SpeculativeConfig
from trtssd.plan import CostCurve, StepCostModel, Timings, Workload, acceptance_from_length, recommend
from trtssd.runtime.protocol import Outcome, Prefill, SpeculateRequest
from trtssd.sampling import SamplingParams, make_generator, processed_probs, sample
from trtssd.spec_decode.backup import BackupCosts, ngram_proposal, prefer_neural
from trtssd.spec_decode.cache import SpeculationCache
from trtssd.spec_decode.fanout import AcceptanceEstimator, PowerLawEstimator, optimal_fanout
from trtssd.spec_decode.saguaro import saguaro_probs, select_forks
from trtssd.spec_decode.tree import TreeLayout, append_chunk

log = logging.getLogger(__name__)


@dataclass
class DraftSequence:
    """What the draft knows of one sequence."""

    seq_id: int
    params: SamplingParams
    generator: torch.Generator | None
    history: list[int]  # prompt + every token the target has emitted
    uncached: list[int] = field(default_factory=list)  # committed on the target, not in draft KV yet
    kv_chain: list[int] = field(default_factory=list)  # tokens written as a chain in region slots 0..
    bonus: int | None = None  # the pending bonus token (emitted, not yet verified past)
    last_spec: list[int] = field(default_factory=list)  # the speculation returned last round
    last_source: str = ""  # "hit", "neural" or "fast"
    cached: bool = False  # the cache holds this sequence's pre-speculation for this round
    fanout: list[int] = field(default_factory=list)  # per-depth fan-out of the cached round
    tree: "TreeResult | None" = None  # the last tree decode, for reusing the branch that hits
    branch: int | None = None  # branch of ``tree`` this round's speculation came from (a hit)


@dataclass(frozen=True)
class TreeResult:
    layout: TreeLayout
    step_logits: list[torch.Tensor]  # per tree step d: [branches, V], the logits s_{d+1} came from
    branch_of: dict[tuple[int, int], int]  # fork (depth, token) -> branch index


@dataclass(frozen=True)
class Answer:
    """Rows answering a SpeculateRequest, in its order."""

    tokens: torch.Tensor  # [B, K] long
    probs: torch.Tensor | None  # [B, K, V] q' rows; None when no row needs them
    point_mass: list[bool]
    hit: list[bool]
    backup: list[str]


class DraftWorker:
    def __init__(self, executor: Executor, spec: SpeculativeConfig):
        self.executor = executor
        self.spec = spec
        self.k = spec.k
        self.seqs: dict[int, DraftSequence] = {}
        self.cache = SpeculationCache()
        self.acceptance = AcceptanceEstimator()
        self.power_law = PowerLawEstimator()
        self.costs = BackupCosts()
        self.forward_costs = StepCostModel()  # draft forward seconds by rows, for the auto fan-out
        self._answered: list[int] = []  # sequences of the last answer, to pre-speculate for
        self._budget = spec.budget  # per-sequence tree width chosen for this round (auto fan-out)

    def calibrate(self, context: int = 128, max_rows: int = 64) -> dict[int, float]:
        """Time draft forwards of 1, 2, 4, ... rows on a scratch sequence, so the auto fan-out
        knows from the first round what a wider tree costs on this machine. Returns {rows: s}."""
        limit = getattr(self.executor, "max_batch_tokens", None) or self.executor.max_seq_len
        context = max(1, min(context, limit, self.executor.max_seq_len // 2))
        cap = min(max_rows, limit, self.executor.max_seq_len - context)
        sizes = [r for r in (1, 2, 4, 8, 16, 32, 64, 128) if r <= cap] or [1]
        sid = -1  # never a request id (the target numbers requests from 0)
        self.executor.add_sequence(sid)
        try:
            self.executor.forward([chain_chunk(sid, [1] * context, 0, last_logits_only=True)])
            self.executor.commit(sid, context)
            points = {}
            for rows in sizes:
                chunk = chain_chunk(sid, [1] * rows, context)
                times = []
                for _ in range(3):  # the first one warms caches; keep the best of the rest
                    t0 = time.perf_counter()
                    self.executor.forward([chunk])
                    times.append(time.perf_counter() - t0)
                points[rows] = min(times[1:])
        finally:
            self.executor.release(sid)
        self.forward_costs.calibrate(points)
        log.info("draft forward seconds by rows: %s", {r: round(t, 4) for r, t in points.items()})
        return points

    # --- sequences ---------------------------------------------------------------------------

    def prefill(self, msg: Prefill) -> None:
        params = msg.params
        # The draft's randomness only shapes proposals, never the output distribution; a seeded
        # request still gets a reproducible draft stream, distinct from the target's.
        seeded = SamplingParams(seed=params.seed + 1) if params.seed is not None else params
        seq = DraftSequence(msg.seq_id, params, make_generator(seeded), list(msg.prompt))
        self.executor.add_sequence(msg.seq_id)
        self.executor.forward([chain_chunk(msg.seq_id, msg.prompt, 0, last_logits_only=True)])
        self.executor.commit(msg.seq_id, len(msg.prompt))
        self.seqs[msg.seq_id] = seq

    def release(self, seq_ids) -> None:
        for sid in seq_ids:
            if self.seqs.pop(sid, None) is not None:
                self.executor.release(sid)
                self.cache.evict(sid)

    # --- answer ------------------------------------------------------------------------------

    def answer(self, req: SpeculateRequest) -> Answer:
        self.release(req.released)
        if req.verify_time_s > 0:
            self.costs.observe("verify_s", req.verify_time_s)
        seqs = [self._apply_outcome(o) for o in req.outcomes]
        found = self._lookup(seqs, req.outcomes)
        misses = [i for i, s in enumerate(found) if s is None]
        use_neural = self._use_neural(len(seqs), len(misses))
        tokens = torch.zeros(len(seqs), self.k, dtype=torch.long)
        probs = None
        if any(not s.params.is_greedy for s in seqs):
            probs = torch.zeros(len(seqs), self.k, self.executor.vocab_size)
        point_mass = [False] * len(seqs)
        hit = [s is not None for s in found]
        backup = [""] * len(seqs)
        for i, spec in enumerate(found):
            if spec is not None:
                tokens[i] = spec.tokens
                if probs is not None and spec.probs is not None:
                    probs[i] = spec.probs
                seqs[i].last_source = "hit"
        if misses and use_neural:
            t0 = time.perf_counter()
            jit_tokens, jit_probs = self._draft_chain([seqs[i] for i in misses])
            self.costs.observe("jit_s", time.perf_counter() - t0)
            for row, i in enumerate(misses):
                tokens[i] = jit_tokens[row]
                if probs is not None and jit_probs is not None:
                    probs[i] = jit_probs[row]
                backup[i] = "neural"
                seqs[i].last_source = "neural"
        elif misses:
            for i in misses:
                tokens[i] = torch.tensor(ngram_proposal(seqs[i].history, self.k))
                point_mass[i] = not seqs[i].params.is_greedy
                backup[i] = "fast"
                seqs[i].last_source = "fast"
        for i, seq in enumerate(seqs):
            seq.last_spec = tokens[i].tolist()
        self._answered = [s.seq_id for s in seqs]
        return Answer(tokens, probs, point_mass, hit, backup)

    def _apply_outcome(self, outcome: Outcome) -> DraftSequence:
        """Advance the draft's view of a sequence by the tokens the target just committed."""
        seq = self.seqs[outcome.seq_id]
        k = outcome.num_accepted
        if seq.last_spec:
            self._observe_outcome(seq, k)
        truth = seq.uncached + ([seq.bonus] if seq.bonus is not None else []) + seq.last_spec[:k]
        reuse = 0
        while reuse < min(len(truth), len(seq.kv_chain)) and truth[reuse] == seq.kv_chain[reuse]:
            reuse += 1
        self.executor.commit(seq.seq_id, reuse)  # KV already written for these: no recompute
        seq.uncached = truth[reuse:]
        seq.kv_chain = []
        seq.history += seq.last_spec[:k] + [outcome.bonus]
        seq.bonus = outcome.bonus
        return seq

    def _observe_outcome(self, seq: DraftSequence, k: int) -> None:
        if seq.last_source in ("hit", "neural"):
            self.acceptance.update(k, len(seq.last_spec))
            self.costs.observe("tokens_neural", k + 1)
        elif seq.last_source == "fast":
            self.costs.observe("tokens_fast", k + 1)

    def _lookup(self, seqs: list[DraftSequence], outcomes) -> list:
        found = [None] * len(seqs)
        if self.spec.mode is not Mode.SSD:
            return found
        for i, (seq, o) in enumerate(zip(seqs, outcomes)):
            if not seq.cached:
                continue
            spec = self.cache.lookup([(seq.seq_id, o.num_accepted, o.bonus)])[0]
            if spec is not None and seq.tree is not None:
                seq.branch = seq.tree.branch_of.get((o.num_accepted, o.bonus))
            depth_fanout = seq.fanout[o.num_accepted] if o.num_accepted < len(seq.fanout) else 0
            if depth_fanout:  # a depth without candidates always misses: no evidence on c or r
                self.power_law.update([depth_fanout], [spec is not None])
            found[i] = spec
            seq.cached = False
            self.cache.evict(seq.seq_id)
        return found

    def _use_neural(self, batch: int, misses: int) -> bool:
        if self.spec.mode is Mode.SD or self.spec.backup is Backup.NEURAL:
            return True
        if self.spec.backup is Backup.FAST:
            return False
        tokens_hit = self.costs.tokens_neural
        return prefer_neural(batch, misses, tokens_hit, self.costs)

    # --- drafting ----------------------------------------------------------------------------

    def _choose_tree_width(self, batch: int) -> None:
        """Choose this round's tree width per sequence (auto fan-out): the speedup model of
        `trtssd.plan` (ALGORITHM.md section 8) over budgets 1..fanout_budget, fed with the live
        draft forward costs and the target's last verify time."""
        if isinstance(self.spec.fanout, tuple):
            return
        law = self.power_law.estimate()
        fast_a = acceptance_from_length(min(max(self.costs.tokens_fast, 1.0), self.k + 1), self.k)
        workload = Workload(self.acceptance.value, r=law.r, c=law.c, fast_acceptance=fast_a)
        # The verify is one measured number; a one-point curve returns it for any size.
        timings = Timings(CostCurve(((1.0, self.costs.verify_s),)), self.forward_costs.curve())
        backups = ("neural",) if self.spec.backup is Backup.NEURAL else ("neural", "fast")
        best = recommend(timings, workload, batch, ks=(self.k,), budgets=range(1, self.spec.budget + 1),
                         backups=backups).ssd
        self._budget = best.budget

    def _fanout(self, seq: DraftSequence) -> list[int]:
        if isinstance(self.spec.fanout, tuple):
            return list(self.spec.fanout)
        if seq.last_source == "fast":
            # A fast-backup proposal almost always accepts 0 tokens: put every branch at depth 0.
            return [self._budget] + [0] * self.k
        law = self.power_law.estimate()
        return optimal_fanout(self._budget, self.k, self.acceptance.value, law.r, law.c)

    def _sample_rows(self, logits: torch.Tensor, seqs: list[DraftSequence], fanouts: list[int]):
        """One token per row from the draft's Saguaro distribution q'; returns (tokens, q' or
        None for greedy rows)."""
        params = [s.params for s in seqs]
        greedy = all(p.is_greedy for p in params)
        if greedy:
            return logits.argmax(dim=-1), None
        q = processed_probs(logits, params)
        # Scale only where forks are cached (F >= 1): with none, lowering q's top token buys no
        # hit and only costs acceptance. (Section 6 would scale the top-1 at F = 0 too.)
        cached = torch.tensor([f if f > 0 else -1 for f in fanouts])
        q_prime = saguaro_probs(q, cached, self.spec.saguaro_c)
        tokens = sample(q_prime, [s.generator for s in seqs])
        return tokens, q_prime

    def _draft_chain(self, seqs: list[DraftSequence]):
        """Just-in-time drafting of K tokens for the given sequences, batched (K forwards)."""
        fan = [self._fanout(s) for s in seqs]
        chunks = []
        for s in seqs:
            head = s.uncached + [s.bonus]
            chunks.append(chain_chunk(s.seq_id, head, self.executor.committed(s.seq_id)))
            s.kv_chain = list(head)
        tokens = torch.zeros(len(seqs), self.k, dtype=torch.long)
        probs = None if all(s.params.is_greedy for s in seqs) else torch.zeros(len(seqs), self.k, self.executor.vocab_size)
        for d in range(self.k):
            logits = torch.stack([out[-1] for out in self.executor.forward(chunks)])
            tok, q = self._sample_rows(logits, seqs, [f[d] if d < len(f) else 0 for f in fan])
            tokens[:, d] = tok
            if probs is not None:
                probs[:, d] = q
            if d + 1 < self.k:
                chunks = []
                for s, t in zip(seqs, tok.tolist()):
                    chunks.append(append_chunk(s.seq_id, self.executor.committed(s.seq_id), [t], len(s.kv_chain)))
                    s.kv_chain.append(t)
        return tokens, probs

    # --- pre-speculation (SSD) ---------------------------------------------------------------

    def prespeculate(self) -> int:
        """Glue, fork, tree and populate for the sequences of the last answer; returns the tree
        branches per sequence it used (mean over the batch, rounded)."""
        seqs = [self.seqs[sid] for sid in self._answered if sid in self.seqs]
        self._answered = []
        if not seqs:
            return 0
        t0 = time.perf_counter()
        branches = self._prespeculate(seqs)
        self.costs.observe("prespec_s", time.perf_counter() - t0)
        return branches

    def _prespeculate(self, seqs: list[DraftSequence]) -> int:
        self._choose_tree_width(len(seqs))
        glue_logits = self._glue(seqs)
        layouts, fanouts = [], []
        for seq, logits in zip(seqs, glue_logits):
            fan = self._fanout(seq)
            fan = self._fit_region(seq, fan)
            scores = logits if seq.params.is_greedy else processed_probs(logits[None], [seq.params])[0]
            forks = select_forks(scores, torch.tensor(seq.last_spec), fan)
            layouts.append(
                TreeLayout(
                    seq.seq_id,
                    self.executor.committed(seq.seq_id),
                    self.k,
                    torch.tensor([j for j, _ in forks], dtype=torch.long),
                    torch.tensor([c for _, c in forks], dtype=torch.long),
                )
            )
            fanouts.append(fan)
        self._tree(seqs, layouts, fanouts)
        return round(sum(sum(f) for f in fanouts) / len(seqs))

    def _glue(self, seqs: list[DraftSequence]) -> list[torch.Tensor]:
        """Write draft KV for [uncached.., b, s_1..s_K]; return the K+1 glue logit rows each.

        On a cache hit the tree branch the speculation came from already holds the KV and the
        logits of b, s_1..s_{K-1} (same tokens, positions and context): its scratch slots are
        copied into place and only s_K is decoded. Other rows decode the whole chain.
        """
        chunks, adopted = [], []
        for s in seqs:
            committed = self.executor.committed(s.seq_id)
            rows = self._adopt_branch(s, committed)
            adopted.append(rows)
            if rows is None:
                toks = s.uncached + [s.bonus] + s.last_spec
                chunks.append(chain_chunk(s.seq_id, toks, committed))
            else:
                chunks.append(append_chunk(s.seq_id, committed, [s.last_spec[-1]], self.k))
        outs = self._timed_forward(chunks)
        glue = []
        for s, out, rows in zip(seqs, outs, adopted):
            self.executor.commit(s.seq_id, len(s.uncached))  # target-committed: now in draft KV
            s.uncached = []
            s.kv_chain = [s.bonus] + s.last_spec
            s.tree, s.branch = None, None
            glue.append(out[-(self.k + 1) :] if rows is None else torch.cat(rows + [out[-1:]]))
        return glue

    def _adopt_branch(self, s: DraftSequence, committed: int) -> list[torch.Tensor] | None:
        """Move the hit branch's KV for b, s_1..s_{K-1} to region slots 0..K-1; return its K
        logit rows, or None when the chain must be decoded (miss, or tokens not yet in KV)."""
        if s.branch is None or s.tree is None or s.uncached or self.k == 0:
            return None
        lay, i = s.tree.layout, s.branch
        steps = torch.arange(self.k)
        src = lay.committed + lay.glue_len + steps * lay.num_branches + i
        self.executor.copy_slots(s.seq_id, src, committed + steps)
        return [s.tree.step_logits[d][i : i + 1] for d in range(self.k)]

    def _timed_forward(self, chunks):
        t0 = time.perf_counter()
        outs = self.executor.forward(chunks)
        self.forward_costs.observe(sum(c.tokens.numel() for c in chunks), time.perf_counter() - t0)
        return outs

    def _fit_region(self, seq: DraftSequence, fan: list[int]) -> list[int]:
        """Trim the fan-out so glue + tree fit the sequence's KV slot (never an error)."""
        room = self.executor.max_seq_len - self.executor.committed(seq.seq_id) - (self.k + 1)
        max_branches = max(room // self.k, 0)
        fan = list(fan)
        while sum(fan) > max_branches:
            j = max(range(len(fan)), key=lambda i: fan[i])
            fan[j] -= 1
        return fan

    def _tree(self, seqs: list[DraftSequence], layouts: list[TreeLayout], fanouts: list[list[int]]) -> None:
        live = [i for i, lay in enumerate(layouts) if lay.num_branches > 0]
        tokens = {i: torch.zeros(layouts[i].num_branches, self.k, dtype=torch.long) for i in live}
        greedy = {i: seqs[i].params.is_greedy for i in live}
        probs = {
            i: None if greedy[i] else torch.zeros(layouts[i].num_branches, self.k, self.executor.vocab_size)
            for i in live
        }
        inputs = {i: layouts[i].fork_token for i in live}
        step_logits: dict[int, list[torch.Tensor]] = {i: [] for i in live}
        for d in range(self.k):
            if not live:
                break
            outs = self._timed_forward([layouts[i].step_chunk(d, inputs[i]) for i in live])
            for i, logits in zip(live, outs):
                step_logits[i].append(logits)
                nb = layouts[i].num_branches
                fan_d = fanouts[i][d] if d < len(fanouts[i]) else 0
                tok, q = self._sample_rows(logits, [seqs[i]] * nb, [fan_d] * nb)
                tokens[i][:, d] = tok
                if q is not None:
                    probs[i][:, d] = q
                inputs[i] = tok
        self.cache_populate(seqs, layouts, fanouts, tokens, probs)
        for i in live:
            keys = zip(layouts[i].fork_depth.tolist(), layouts[i].fork_token.tolist())
            seqs[i].tree = TreeResult(layouts[i], step_logits[i], {key: b for b, key in enumerate(keys)})

    def cache_populate(self, seqs, layouts, fanouts, tokens, probs) -> None:
        for i, (seq, lay) in enumerate(zip(seqs, layouts)):
            self.cache.evict(seq.seq_id)
            seq.fanout = fanouts[i]
            seq.cached = True
            if lay.num_branches == 0:
                continue
            keys = list(zip(lay.fork_depth.tolist(), lay.fork_token.tolist()))
            self.cache.populate(seq.seq_id, keys, tokens[i], probs[i])
