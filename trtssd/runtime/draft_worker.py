"""The draft rank's work, free of any transport: the paper's draft-side round.

    answer       the speculation for each sequence's actual outcome: from its cache on a hit,
                 from a backup speculator on a miss (docs/algorithm.md sections 3-4)
    glue         draft KV for b, s_1..s_K and the K+1 rows of "what the bonus would be"
    fork         the likely bonus tokens per outcome depth (section 3 step 2, section 7 fan-out)
    tree         K tokens for every fork, all branches of all sequences in one forward per step
    populate     the next round's cache

`answer` runs while the target waits; `prespeculate` (glue -> fork -> tree -> populate) runs
while the target verifies. A new sequence's first round has no speculation to glue to: while the
target prefills, `prespeculate_first_tokens` forks the draft's guesses of the first token and
drafts a tree from each, so that round can hit too. Every proposal is sampled from a known
distribution that travels with it (Saguaro q', `trtssd.spec_decode.saguaro.saguaro_probs`), or
is deterministic and marked as a point mass, so the target's verification is exact either way.

Seeded sampled requests (`SamplingParams.seeded_sampling`): the draft draws its uniforms from a
counter-based stream keyed by (seed, round, outcome): the tree branch for outcome (k, b) of round
r and a just-in-time draft answering that outcome draw the same numbers. Such rows sample from the
plain draft distribution (Saguaro's skew depends on the live tree budget) and a miss is always
answered by the neural backup, so their proposals, and with them the output, do not depend on
timing, batch or cache hits (a greedy row's output never depends on its proposals).

Penalties, logit bias, bad words and min_tokens: the draft processes its q' with them as the
target does its p (`trtssd.sampling.adjusted_logits`), each chain with its own history: the
sequence's prompt and output, then the chain's tokens so far (a just-in-time draft's, a glue row's
speculation before it, a tree branch's path from the speculation through its fork token).
Exactness does not rest on this (the target processes its own p), acceptance does.

Constrained requests (structured outputs): the draft samples from its grammar-masked q', each
chain with its own grammar state (docs/structured-outputs.md). Exactness does not rest on this
(the target masks its own p), acceptance does.
"""

from __future__ import annotations

import hashlib
import logging
import time
from dataclasses import dataclass, field

import torch

from trtssd.backends.base import Executor, chain_chunk
from trtssd.config import Backup, Mode, Source, SpeculativeConfig
from trtssd.runtime.prefix_cache import PrefixCache
from trtssd.runtime.protocol import Outcome, Prefill, SpeculateRequest
from trtssd.runtime.calibration import calibration, calibration_key_fields, time_forwards, time_tree_steps
from trtssd.sampling import (History, SamplingParams, adjusted_logits, greedy_tokens, processed_probs,
                             sample_with_uniforms)
from trtssd.spec_decode.backup import BackupCosts, ngram_proposal, prefer_neural
from trtssd.spec_decode.cache import CachedSpeculation, PreSpeculation, pre_speculation
from trtssd.spec_decode.fanout import AcceptanceEstimator, PowerLawEstimator, optimal_fanout
from trtssd.spec_decode.speedup import (CostCurve, StepCostModel, Timings, Workload, acceptance_from_length,
                                        best_ssd)
from trtssd.spec_decode.saguaro import saguaro_probs, select_forks_batched
from trtssd.spec_decode.tree import TreeLayout, append_chunk
from trtssd.structured.grammar import GrammarState, Grammars, apply_bitmask, chain_bitmask, new_bitmask

log = logging.getLogger(__name__)

NO_SCALING = -1  # a fan-out of -1 leaves a row's q unscaled in saguaro_probs
# Rounds a tree budget chosen by the speedup model is kept: its inputs are running averages that
# move slowly, and the search costs milliseconds a round the draft would otherwise wait out.
BUDGET_REFRESH_ROUNDS = 8


@dataclass
class DraftSequence:
    """What the draft knows of one sequence.

    Between rounds the draft's KV holds the committed prefix (``committed``) plus a chain written
    in the region after it (``kv_chain``: glue or a just-in-time draft); ``uncached`` are tokens
    the target committed that the draft's KV does not hold yet (written by the next glue or draft).
    """

    seq_id: int
    params: SamplingParams
    history: list[int]  # prompt + every token the target has emitted
    round: int = 0  # speculations answered so far: keys the seeded draft streams
    uncached: list[int] = field(default_factory=list)
    kv_chain: list[int] = field(default_factory=list)
    bonus: int | None = None  # the pending bonus token (emitted, not yet verified past)
    last_spec: list[int] = field(default_factory=list)  # the speculation returned last
    last_source: Source | None = None
    hit: tuple[PreSpeculation, CachedSpeculation] | None = None  # this round's hit, for the glue
    cached_tokens: int = 0  # prompt tokens the prefix cache gave (not prefilled)
    grammar: GrammarState | None = None  # a constrained request's grammar, after every emitted token
    prompt_len: int = field(init=False)  # history[:prompt_len] is the prompt (all of history when made)

    def __post_init__(self) -> None:
        self.prompt_len = len(self.history)


@dataclass(frozen=True)
class Answer:
    """Rows answering a SpeculateRequest, in its order."""

    tokens: torch.Tensor  # [B, K] long
    probs: torch.Tensor | None  # [B, K, V] q' rows; None when no row needs them
    point_mass: list[bool]
    sources: list[Source]
    cached_tokens: list[int]  # per row: prompt tokens the prefix cache gave its sequence


@dataclass(frozen=True)
class Drafts:
    """K proposals per row and the rows they were drawn from (None: every row greedy)."""

    tokens: torch.Tensor  # [n, K] long
    probs: torch.Tensor | None  # [n, K, V]


class DraftWorker:
    def __init__(self, executor: Executor, spec: SpeculativeConfig, prefix_cache_seqs: int | None = 0,
                 grammars: Grammars | None = None, prefix_cache_mib: int | None = None):
        """grammars: the draft tokenizer's grammar compiler (None: constrained requests are drafted
        unmasked, which costs acceptance, never exactness)."""
        self.executor = executor
        self.grammars = grammars
        self.prefix_cache = PrefixCache(executor, prefix_cache_seqs, prefix_cache_mib)
        self._prefilled: dict[int, tuple[int, int]] = {}  # partly prefilled -> (tokens in, of them cached)
        self.spec = spec
        self.k = spec.k
        self.seqs: dict[int, DraftSequence] = {}
        self.cache: dict[int, PreSpeculation] = {}  # seq_id -> its pre-speculation for next round
        self.acceptance = AcceptanceEstimator()
        self.power_law = PowerLawEstimator()
        self.costs = BackupCosts()
        self.forward_costs = StepCostModel()  # chain forward seconds by rows (glue, backup drafts)
        self.tree_costs = StepCostModel()  # tree step seconds (forward and sampling) by branches
        self.calibrated_step_s: dict[int, float] | None = None  # chain forward seconds by rows, once calibrated
        self._answered: list[int] = []  # sequences of the last answer, to pre-speculate for
        self._first: dict[int, torch.Tensor] = {}  # new sequences' prompt logits [V], until their first tree
        self._budgets: dict[int, tuple[int, int]] = {}  # batch size -> (tree budget, rounds left)
        self.eos_token_ids: tuple[int, ...] = ()  # the target's end tokens, as its prefills say

    def calibrate(self, context: int = 128, max_rows: int = 64) -> dict[int, float]:
        """Time draft chain forwards of 1, 2, 4, ... rows and tree steps of as many branches on a
        scratch sequence, so the auto fan-out knows from the first round what a wider tree costs
        on this machine. Returns the chain forwards' {rows: s}.

        A calibration is stored per machine and model and reused at the next start
        (`calibration.calibration`): timing is most of a large draft's start-up."""
        fields = calibration_key_fields(self.executor, k=self.k, max_rows=max_rows, context=context)
        points, tree, stored = calibration(fields, lambda: (time_forwards(self.executor, max_rows, context),
                                                            time_tree_steps(self.executor, self.k, max_rows, context)))
        self.forward_costs.calibrate(points)
        self.tree_costs.calibrate(tree)
        self.calibrated_step_s = dict(points)
        log.info("draft seconds by rows (%s): chain forward %s, tree step %s", "stored" if stored else "timed",
                 {r: round(t, 4) for r, t in points.items()}, {r: round(t, 4) for r, t in tree.items()})
        return points

    # --- sequences ---------------------------------------------------------------------------

    def prefill(self, msg: Prefill) -> None:
        """A new sequence's prompt, after its cached prefix; or its next piece (``msg.upto``);
        or, for a sample forked from another (``msg.fork_of``), that sample's prompt KV."""
        sid, prompt = msg.seq_id, list(msg.prompt)
        self.eos_token_ids = msg.eos_token_ids
        if msg.fork_of is not None and sid not in self._prefilled and self._take_prompt(msg):
            return
        if sid not in self._prefilled:
            cached = self.prefix_cache.start(sid, prompt, reuse=self.prefix_cache.reuse_keeps_bits(msg.params))
            self._prefilled[sid] = (cached, cached)
        start, cached = self._prefilled[sid]
        end = len(prompt) if msg.upto is None else msg.upto
        if end <= start:
            return  # the prefix cache gave this piece
        logits = self.executor.forward([chain_chunk(sid, prompt[start:end], start, last_logits_only=True)])[0]
        self.executor.commit(sid, end - start)
        if end < len(prompt):
            self._prefilled[sid] = (end, cached)
            return
        del self._prefilled[sid]
        self.prefix_cache.index(sid, prompt)
        self.seqs[sid] = DraftSequence(sid, msg.params, prompt, cached_tokens=cached, grammar=self._grammar(msg.params))
        if self.spec.mode is Mode.SSD:
            self._first[sid] = logits[-1]

    def _take_prompt(self, msg: Prefill) -> bool:
        """A sample of an n-sample request: the whole prompt's KV from the sample that holds it
        (`Executor.share_prefix`), so the draft prefills a request's prompt once, and its first-token
        guesses too. False when the draft no longer holds that sample's prompt (it is prefilled)."""
        source, prompt = self.seqs.get(msg.fork_of), list(msg.prompt)
        if source is None or source.history[:len(prompt)] != prompt:
            return False
        self.prefix_cache.start(msg.seq_id, prompt, reuse=False)
        self.executor.share_prefix(msg.fork_of, msg.seq_id, len(prompt))
        self.seqs[msg.seq_id] = DraftSequence(msg.seq_id, msg.params, prompt, cached_tokens=len(prompt),
                                              grammar=self._grammar(msg.params))
        if msg.fork_of in self._first:
            self._first[msg.seq_id] = self._first[msg.fork_of]
        return True

    def _grammar(self, params: SamplingParams) -> GrammarState | None:
        if params.constraint is None or self.grammars is None:
            return None
        try:
            return self.grammars.start(params.constraint)
        except Exception:  # noqa: BLE001 - the target checked it; the draft then drafts unmasked
            log.exception("the draft could not compile a constraint the target accepted; drafting unmasked")
            return None

    def release(self, seq_ids) -> None:
        for sid in seq_ids:
            self._first.pop(sid, None)
            self.cache.pop(sid, None)
            if self.seqs.pop(sid, None) is not None or self._prefilled.pop(sid, None) is not None:
                self.prefix_cache.finish(sid)

    # --- the round ---------------------------------------------------------------------------

    def answer(self, req: SpeculateRequest) -> Answer:
        """The speculation for each row's actual outcome: cached on a hit, else a backup."""
        self.release(req.released)
        for o in req.outcomes:  # asked before its first tree was made: a backup answers it
            self._first.pop(o.seq_id, None)
        seqs = [self._advance(o) for o in req.outcomes]
        pres = [self.cache.pop(s.seq_id, None) for s in seqs]
        # After plain rounds the pre-speculation answers a state the sequence has moved past.
        pres = [None if o.plain else pre for pre, o in zip(pres, req.outcomes)]
        cached = [pre.lookup(o.num_accepted, o.bonus) if pre else None for pre, o in zip(pres, req.outcomes)]
        self._observe(seqs, req, pres, cached)
        for seq, pre, found in zip(seqs, pres, cached):
            seq.hit = (pre, found) if found is not None else None
        answer = self._fill(seqs, req.outcomes, cached)
        for seq, tokens, source in zip(seqs, answer.tokens.tolist(), answer.sources):
            seq.last_spec, seq.last_source = tokens, source
            seq.round += 1
        self._answered = [s.seq_id for s in seqs]
        return answer

    def prespeculate(self) -> int:
        """SSD, while the target verifies: glue -> fork -> tree -> populate for the sequences of
        the last answer. Returns the tree branches per sequence it used (mean, rounded)."""
        seqs = [self.seqs[sid] for sid in self._answered if sid in self.seqs]
        self._answered = []
        if not seqs:
            return 0
        t0 = time.perf_counter()
        glue_logits = self._glue(seqs)
        budget = self._tree_budget(len(seqs))
        layouts = self._fork(seqs, glue_logits, [self._fanout(s, budget) for s in seqs])
        drafts, step_logits = self._tree(seqs, layouts)
        self._populate(seqs, layouts, drafts, step_logits)
        self.costs.observe("prespec_s", time.perf_counter() - t0)
        return round(sum(lay.num_branches for lay, _ in layouts) / len(seqs))

    def prespeculate_first_tokens(self) -> int:
        """SSD for the first round, while the target prefills: fork the draft's top guesses of
        each new sequence's first token (all at depth 0, nothing is glued) and draft K tokens
        after each, so the first round is a cache hit rather than a just-in-time draft. Returns
        the sequences it made trees for."""
        first, self._first = self._first, {}
        seqs = [self.seqs[sid] for sid in first if sid in self.seqs]
        if not seqs:
            return 0
        prompt_logits = torch.stack([first[s.seq_id] for s in seqs])[:, None, :]  # one row: depth 0
        budget = self._tree_budget(len(seqs))
        layouts = self._fork(seqs, prompt_logits, [[budget] + [0] * self.k for _ in seqs], glued=False)
        # Saguaro skews a token by the fan-out that will be cached after it: a regular tree's.
        drafts, step_logits = self._tree(seqs, layouts, [self._fanout(s, budget) for s in seqs])
        self._populate(seqs, layouts, drafts, step_logits)
        return len(seqs)

    # --- answer ------------------------------------------------------------------------------

    def _advance(self, outcome: Outcome) -> DraftSequence:
        """Take in the tokens the target just committed; keep the KV of the ones already written."""
        seq = self.seqs[outcome.seq_id]
        emitted = seq.last_spec[:outcome.num_accepted] + [outcome.bonus, *outcome.plain]
        truth = seq.uncached + ([seq.bonus] if seq.bonus is not None else []) + emitted[:-1]
        reuse = 0
        while reuse < min(len(truth), len(seq.kv_chain)) and truth[reuse] == seq.kv_chain[reuse]:
            reuse += 1
        self.executor.commit(seq.seq_id, reuse)
        seq.uncached = truth[reuse:]
        seq.kv_chain = []
        seq.history += emitted
        seq.bonus = emitted[-1]
        if seq.grammar is not None and seq.grammar.advance(emitted) != len(emitted):
            log.warning("seq %d: the target emitted a token the draft's grammar does not allow; drafting unmasked",
                        seq.seq_id)
            seq.grammar = None
        return seq

    def _observe(self, seqs: list[DraftSequence], req: SpeculateRequest, pres: list[PreSpeculation | None],
                 cached: list[CachedSpeculation | None]) -> None:
        """Every running estimate learns from this round's outcomes, here and only here."""
        if req.verify_time_s > 0:
            self.costs.observe("verify_s", req.verify_time_s)
        for seq, outcome, pre, found in zip(seqs, req.outcomes, pres, cached):
            if outcome.grammar:
                continue  # the target verified the grammar's tokens, not this speculation
            if seq.last_source in (Source.HIT, Source.NEURAL, Source.SD):
                self.acceptance.update(outcome.num_accepted, outcome.num_drafts or self.k)
                self.costs.observe("tokens_neural", outcome.num_accepted + 1)
            elif seq.last_source is Source.FAST:
                self.costs.observe("tokens_fast", outcome.num_accepted + 1)
            # The first token's guesses are not bonus guesses after a rejection: not the law's evidence.
            forks = pre.forks_at(outcome.num_accepted) if pre is not None and pre.layout.glued else 0
            if forks:  # a depth without candidates always misses: no evidence on c or r
                self.power_law.update([forks], [found is not None])

    def _fill(self, seqs: list[DraftSequence], outcomes, cached: list[CachedSpeculation | None]) -> Answer:
        """Hits from the cache; misses from the neural backup (drafted now) or the fast one."""
        misses = [i for i, found in enumerate(cached) if found is None]
        drafted = self._draft_rows(seqs, outcomes, self._neural_rows(seqs, misses))
        backup = Source.SD if self.spec.mode is Mode.SD else Source.NEURAL
        n = len(seqs)
        tokens = torch.zeros(n, self.k, dtype=torch.long)
        probs = None if all(s.params.is_greedy for s in seqs) else torch.zeros(n, self.k, self.executor.vocab_size)
        sources = []
        for i, (seq, found) in enumerate(zip(seqs, cached)):
            if found is not None:
                source, row, q = Source.HIT, found.tokens, found.probs
            elif i in drafted:
                source, (row, q) = backup, drafted[i]
            else:  # deterministic tokens: a point mass on sampled rows
                source, row, q = Source.FAST, torch.tensor(ngram_proposal(seq.history, self.k)), None
            tokens[i] = row
            if probs is not None and q is not None:
                probs[i] = q
            sources.append(source)
        point_mass = [src is Source.FAST and not s.params.is_greedy for s, src in zip(seqs, sources)]
        return Answer(tokens, probs, point_mass, sources, [s.cached_tokens for s in seqs])

    def _draft_rows(self, seqs: list[DraftSequence], outcomes, rows: list[int]) -> dict[int, tuple]:
        """``rows`` drafted just in time, in one batch: row -> (K tokens, their q' rows or None)."""
        if not rows:
            return {}
        t0 = time.perf_counter()
        drafts = self._draft_chains([seqs[i] for i in rows], [outcomes[i] for i in rows])
        self.costs.observe("jit_s", time.perf_counter() - t0)
        return {i: (drafts.tokens[r], None if drafts.probs is None else drafts.probs[r]) for r, i in enumerate(rows)}

    def _neural_rows(self, seqs: list[DraftSequence], misses: list[int]) -> list[int]:
        """Which missed rows the draft drafts just in time (the rest get the fast backup)."""
        if self.spec.mode is Mode.SD or self.spec.backup is Backup.NEURAL:
            return misses
        if self.spec.backup is Backup.FAST:
            return []
        if prefer_neural(len(seqs), len(misses), self.costs.tokens_neural, self.costs):
            return misses
        return [i for i in misses if seqs[i].params.seeded_sampling]  # a seed promises timing-free proposals

    # --- drafting ----------------------------------------------------------------------------

    def _draft_chains(self, seqs: list[DraftSequence], outcomes: list[Outcome]) -> Drafts:
        """Just-in-time drafting of K tokens per sequence, batched (at most K forwards): sd, and the
        neural backup of a missed SSD row. Text a row's grammar forces is taken as tokens without
        a forward (`_take_forced`); the forward after it writes them all at once."""
        # sd has no cache, so no fan-out for Saguaro's skew to follow
        fanouts = [self._fanout(s) if self.spec.mode is Mode.SSD else [0] * (self.k + 1) for s in seqs]
        uniforms = self._uniforms(seqs, [(s.round, o.num_accepted, o.bonus) for s, o in zip(seqs, outcomes)])
        states = [s.grammar.fork() if s.grammar is not None else None for s in seqs]
        chains = [_Chain(s.uncached + [s.bonus]) for s in seqs]  # the KV chain is empty after _advance
        for seq, state, chain in zip(seqs, states, chains):
            self._take_forced(seq, state, chain)
        while live := [i for i, c in enumerate(chains) if len(c.tokens) < self.k]:
            outs = self.executor.forward([self._extend_chain(seqs[i], chains[i].take_pending()) for i in live])
            depth = [len(chains[i].tokens) for i in live]
            tok, q = self._sample(torch.stack([out[-1] for out in outs]), [seqs[i] for i in live],
                                  [fanouts[i][d] for i, d in zip(live, depth)],
                                  torch.stack([uniforms[i, d] for i, d in zip(live, depth)]),
                                  [states[i] for i in live], [self._history(seqs[i], chains[i].tokens) for i in live])
            for j, i in enumerate(live):
                chains[i].add(int(tok[j]), None if q is None else q[j])
                self._take_forced(seqs[i], states[i], chains[i])
        return self._chain_drafts(chains, all(s.params.is_greedy for s in seqs))

    def _take_forced(self, seq: DraftSequence, state: GrammarState | None, chain: "_Chain") -> None:
        """The tokens the row's grammar forces next, as point masses (a one-hot q), up to K. Not
        for a seeded sampled row: its proposals must be what the tree branch for the same outcome
        drafts (the seed's promise), and trees sample forced text like any other."""
        if state is None or seq.params.seeded_sampling:
            return
        forced = state.forced_tokens(self.k - len(chain.tokens))
        if state.advance(forced) != len(forced):
            return
        for tok in forced:
            chain.add(tok, None, forced=True)

    def _chain_drafts(self, chains: list["_Chain"], greedy: bool) -> Drafts:
        """The chains as Drafts: a forced token's q is its point mass (one-hot); None where every
        row is greedy (verified by argmax, no q read)."""
        tokens = torch.tensor([c.tokens for c in chains], dtype=torch.long)
        if greedy:
            return Drafts(tokens, None)
        vocab = self.executor.vocab_size
        probs = torch.zeros(len(chains), self.k, vocab)
        for i, c in enumerate(chains):
            for d, (q, forced) in enumerate(zip(c.probs, c.forced)):
                if forced:
                    probs[i, d, c.tokens[d]] = 1.0
                elif q is not None:
                    probs[i, d] = q
        return Drafts(tokens, probs)

    def _extend_chain(self, seq: DraftSequence, tokens: list[int]):
        """The forward input writing ``tokens`` after the sequence's region chain, which they join."""
        chunk = append_chunk(seq.seq_id, self.executor.committed(seq.seq_id), tokens, len(seq.kv_chain))
        seq.kv_chain += tokens
        return chunk

    def _sample(self, logits: torch.Tensor, seqs: list[DraftSequence], fanouts: list[int],
                uniforms: torch.Tensor, states: list[GrammarState | None] | None = None,
                history: list[History | None] | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One token per row from its q' (argmax on greedy rows); returns (tokens, q' rows or None
        when every row is greedy). ``fanouts[i]`` is F at the depth the token is drawn for.
        ``states``: per row, the grammar state the token is drawn at (None: free), masked by it
        and advanced past the drawn token. ``history``: per row, the tokens before the one drawn
        (`_history`), for params that adjust the logits."""
        if states is not None and any(st is not None for st in states):
            logits = _masked(logits, states)
            tokens, q = self._sample(logits, seqs, fanouts, uniforms, history=history)
            for i, (st, tok) in enumerate(zip(states, tokens.tolist())):
                if st is not None and not st.accept(tok):
                    states[i] = None  # a finished grammar: what follows is never emitted
            return tokens, q
        params = [s.params for s in seqs]
        if all(p.is_greedy for p in params):
            return greedy_tokens(logits, params, history), None
        q = processed_probs(logits, params, history)
        q_prime = saguaro_probs(q, torch.tensor([self._saguaro_fanout(s, f) for s, f in zip(seqs, fanouts)]),
                                self.spec.saguaro_c)
        tokens = sample_with_uniforms(q_prime, uniforms)
        greedy = torch.tensor([p.is_greedy for p in params])
        return torch.where(greedy, q.argmax(dim=-1), tokens), q_prime  # a greedy row's q: one-hot at its argmax

    def _history(self, seq: DraftSequence, chain: list[int]) -> History | None:
        """What comes before the token a chain draws next: the sequence's prompt and output, then
        ``chain`` (the chain's tokens after the output); None where the params adjust nothing."""
        if not seq.params.adjusts_logits:
            return None
        return History(seq.history[:seq.prompt_len], seq.history[seq.prompt_len:] + list(chain), self.eos_token_ids)

    def _saguaro_fanout(self, seq: DraftSequence, fanout: int) -> int:
        """F for Saguaro's scaling of this row, or NO_SCALING. sd drafts from the plain q (it has
        no cache); seeded sampled rows too (the skew would follow the live tree budget); with no fork
        cached at this depth, lowering q's top token buys no hit and only costs acceptance."""
        return NO_SCALING if self.spec.mode is Mode.SD or seq.params.seeded_sampling or fanout <= 0 else fanout

    def _uniforms(self, seqs: list[DraftSequence], keys: list[tuple[int, int, int]]) -> torch.Tensor:
        """[n, K] uniforms, row i for the chain answering outcome keys[i] = (round, k, bonus).
        Seeded sampled rows draw from a stream keyed by (seed, "draft", round, k, bonus), so the tree
        branch and a just-in-time draft for the same outcome draw the same numbers; other rows
        use torch's global RNG."""
        out = torch.rand(len(seqs), self.k, dtype=torch.float64)
        for i, (seq, key) in enumerate(zip(seqs, keys)):
            if seq.params.seeded_sampling:
                stream = torch.Generator().manual_seed(_stream_seed(seq.params.seed, key))
                out[i] = torch.rand(self.k, generator=stream, dtype=torch.float64)
        return out

    # --- pre-speculation (SSD) ---------------------------------------------------------------

    def _tree_budget(self, batch: int) -> int:
        """`_choose_tree_budget`, chosen again every BUDGET_REFRESH_ROUNDS rounds of a batch size."""
        budget, left = self._budgets.get(batch, (0, 0))
        if left <= 0:
            budget, left = self._choose_tree_budget(batch), BUDGET_REFRESH_ROUNDS
        self._budgets[batch] = (budget, left - 1)
        return budget

    def _choose_tree_budget(self, batch: int) -> int:
        """Branches per sequence this round. Auto fan-out: the speedup model (docs/algorithm.md
        section 8) over budgets 1..fanout_budget, fed with the live draft forward costs and the
        target's last verify time."""
        if self.spec.fixed_fanout is not None:
            return self.spec.budget
        law = self.power_law.estimate()
        fast_a = acceptance_from_length(min(max(self.costs.tokens_fast, 1.0), self.k + 1), self.k)
        workload = Workload(self.acceptance.value, r=law.r, c=law.c, fast_acceptance=fast_a)
        # The verify is one measured number; a one-point curve returns it for any size.
        timings = Timings(CostCurve(((1.0, self.costs.verify_s),)), self.forward_costs.curve(),
                          tree=self.tree_costs.curve())
        backups = ("neural",) if self.spec.backup is Backup.NEURAL else ("neural", "fast")
        best = best_ssd(timings, workload, batch, ks=(self.k,), budgets=range(1, self.spec.budget + 1),
                        backups=backups)
        return best.budget

    def _fanout(self, seq: DraftSequence, budget: int | None = None) -> list[int]:
        """F_0..F_K for a sequence: fixed, all at depth 0 after a fast backup (it almost always
        accepts nothing), else section 7's allocation of ``budget`` from the live a, c, r."""
        if self.spec.fixed_fanout is not None:
            return list(self.spec.fixed_fanout)
        budget = self.spec.budget if budget is None else budget
        if seq.last_source is Source.FAST:
            return [budget] + [0] * self.k
        law = self.power_law.estimate()
        return optimal_fanout(budget, self.k, self.acceptance.value, law.r, law.c)

    def _glue(self, seqs: list[DraftSequence]) -> torch.Tensor:
        """Write draft KV for [uncached.., b, s_1..s_K]; return the K+1 glue logit rows each, [n, K+1, V].

        On a hit the tree branch the speculation came from already holds the KV and the logits
        of b, s_1..s_{K-1} (same tokens, positions and context): its scratch slots are copied
        into place and only s_K is decoded. Other rows decode the whole chain.
        """
        chunks, adopted = [], []
        for s in seqs:
            committed = self.executor.committed(s.seq_id)
            rows = self._adopt_branch(s, committed)
            adopted.append(rows)
            if rows is None:
                chunks.append(chain_chunk(s.seq_id, s.uncached + [s.bonus] + s.last_spec, committed))
            else:
                chunks.append(append_chunk(s.seq_id, committed, [s.last_spec[-1]], self.k))
        t0 = time.perf_counter()
        outs = self.executor.forward(chunks)
        self.forward_costs.observe(sum(c.tokens.numel() for c in chunks), time.perf_counter() - t0)
        glue = []
        for s, out, rows in zip(seqs, outs, adopted):
            self.executor.commit(s.seq_id, len(s.uncached))  # target-committed: now in draft KV
            s.uncached = []
            s.kv_chain = [s.bonus] + s.last_spec
            s.hit = None
            glue.append(out[-(self.k + 1):] if rows is None else torch.cat(rows + [out[-1:]]))
        return torch.stack(glue)

    def _adopt_branch(self, s: DraftSequence, committed: int) -> list[torch.Tensor] | None:
        """Move the hit branch's KV for b, s_1..s_{K-1} to region slots 0..K-1; return its K
        logit rows, or None when the chain must be decoded (miss, or tokens not yet in KV)."""
        if s.hit is None or s.uncached:
            return None
        pre, found = s.hit
        lay, i = pre.layout, found.branch
        steps = torch.arange(self.k)
        src = lay.committed + lay.glue_len + steps * lay.num_branches + i
        self.executor.copy_slots(s.seq_id, src, committed + steps)
        return [pre.step_logits[d][i:i + 1] for d in range(self.k)]

    def _fork(self, seqs: list[DraftSequence], logits: torch.Tensor, fans: list[list[int]],
              glued: bool = True) -> list[tuple[TreeLayout, list[int]]]:
        """The fork candidates of every sequence (one batched top-k), as tree layouts with their
        F_0..F_K. ``logits`` [n, rows, V]: row j is what the bonus would be after j accepted, the
        K+1 glue rows; unglued, the prompt's last row alone (the first token has no speculation)."""
        fans = [self._fit(s, fan) for s, fan in zip(seqs, fans)]
        depths = logits.shape[1]
        if any(s.grammar is not None for s in seqs):  # candidates the grammar allows at each depth
            logits = torch.stack([_masked(logits[i], [s.grammar] * depths, s.last_spec if glued else [])
                                  for i, s in enumerate(seqs)])
        proposals = torch.tensor([s.last_spec if glued else [] for s in seqs], dtype=torch.long)
        forks = select_forks_batched(self._fork_scores(logits, seqs, glued), proposals.view(len(seqs), depths - 1),
                                     torch.tensor(fans)[:, :depths])
        layouts = []
        for i, (s, fan) in enumerate(zip(seqs, fans)):
            mine = forks.seq_index == i
            layouts.append((TreeLayout(s.seq_id, self.executor.committed(s.seq_id), self.k, forks.depth[mine],
                                       forks.token[mine], glued), fan))
        return layouts

    def _fork_scores(self, logits: torch.Tensor, seqs: list[DraftSequence], glued: bool = True) -> torch.Tensor:
        """What fork candidates are ranked by, [n, rows, V]: greedy rows by their adjusted logits
        (the argmax chain's order), the others by the processed q the bonus is drawn against. Row
        j follows the speculation's first j tokens (glued; unglued: the prompt's last row alone)."""
        params = [s.params for s in seqs]
        history = [self._history(s, []) for s in seqs]
        history = [None if h is None else h.along(s.last_spec if glued else []) for h, s in zip(history, seqs)]
        sampled = [i for i, p in enumerate(params) if not p.is_greedy]
        if not sampled and not any(history):
            return logits
        scores = adjusted_logits(logits, params, history)
        if sampled:
            scores = scores.clone() if scores is logits else scores  # the glue rows stay as they are
            scores[sampled] = processed_probs(logits[sampled], [params[i] for i in sampled], [history[i] for i in sampled])
        return scores

    def _fit(self, seq: DraftSequence, fan: list[int]) -> list[int]:
        """Trim the fan-out to what can exist (never an error): at most V - 1 candidates below
        depth K (the rejected proposal is excluded) and V at K, and a tree that fits the
        sequence's KV slot after the glue."""
        vocab = self.executor.vocab_size
        fan = [min(f, vocab - 1 if j < self.k else vocab) for j, f in enumerate(fan)]
        room = self.executor.max_seq_len - self.executor.committed(seq.seq_id) - (self.k + 1)
        max_branches = max(room // self.k, 0)
        while sum(fan) > max_branches:
            j = max(range(len(fan)), key=lambda i: fan[i])
            fan[j] -= 1
        return fan

    def _tree(self, seqs: list[DraftSequence], layouts: list[tuple[TreeLayout, list[int]]],
              saguaro_fans: list[list[int]] | None = None):
        """K tokens for every branch of every sequence: one forward per depth, all batched.
        ``saguaro_fans``: per sequence, the F_d its tokens are skewed by (default: its tree's).
        Returns the drafts of all branches in sequence order and each step's logits."""
        if saguaro_fans is None:
            saguaro_fans = [fan for _, fan in layouts]
        branch_seqs, keys, fan_rows = [], [], []
        for s, (lay, _), fan in zip(seqs, layouts, saguaro_fans):
            for j, c in zip(lay.fork_depth.tolist(), lay.fork_token.tolist()):
                branch_seqs.append(s)
                keys.append((s.round, j, c))
                fan_rows.append(fan)
        live = [i for i, (lay, _) in enumerate(layouts) if lay.num_branches]
        if not branch_seqs:
            return Drafts(torch.zeros(0, self.k, dtype=torch.long), None), []
        uniforms = self._uniforms(branch_seqs, keys)
        states = [_branch_state(s, key[1], key[2]) for s, key in zip(branch_seqs, keys)]
        # Each branch's tokens after the sequence's output: the speculation to its fork, the fork
        # token, then what the branch drafts (kept only where the params adjust the logits).
        paths = [s.last_spec[:j] + [c] if s.params.adjusts_logits else None for s, (_, j, c) in zip(branch_seqs, keys)]
        inputs = [layouts[i][0].fork_token for i in live]
        steps, step_logits = [], []
        for d in range(self.k):
            t0 = time.perf_counter()
            logits = torch.cat(self.executor.forward([layouts[i][0].step_chunk(d, x) for i, x in zip(live, inputs)]))
            history = [None if path is None else self._history(s, path) for s, path in zip(branch_seqs, paths)]
            tok, q = self._sample(logits, branch_seqs, [f[d] for f in fan_rows], uniforms[:, d], states, history)
            if any(path is not None for path in paths):
                for path, t in zip(paths, tok.tolist()):
                    if path is not None:
                        path.append(t)
            # Sampling is part of a step's price: over a 152k vocabulary it is not negligible.
            self.tree_costs.observe(len(branch_seqs), time.perf_counter() - t0)
            steps.append((tok, q))
            step_logits.append(logits)
            inputs = list(tok.split([layouts[i][0].num_branches for i in live]))
        return _stack(steps), step_logits

    def _populate(self, seqs: list[DraftSequence], layouts, drafts: Drafts, step_logits: list[torch.Tensor]) -> None:
        """Each sequence's branches become its cache for the next round."""
        start = 0
        for s, (lay, fan) in zip(seqs, layouts):
            rows = slice(start, start + lay.num_branches)
            probs = None if drafts.probs is None or s.params.is_greedy else drafts.probs[rows]
            self.cache[s.seq_id] = pre_speculation(tuple(fan), lay, tuple(x[rows] for x in step_logits),
                                                   drafts.tokens[rows], probs)
            start = rows.stop


def _masked(logits: torch.Tensor, states: list[GrammarState | None], chain: list[int] | None = None) -> torch.Tensor:
    """Logits [n, V] masked row by row: without ``chain``, row i by states[i]'s next-token mask;
    with it, all rows share states[0] and row j is masked by the state after ``chain[:j]``."""
    vocab = logits.shape[-1]
    if chain is not None:
        return logits if states[0] is None else apply_bitmask(logits, chain_bitmask(states[0], chain, logits.shape[0], vocab))
    bitmask = new_bitmask(logits.shape[0], vocab)
    for i, st in enumerate(states):
        if st is not None:
            st.fill(bitmask, i)
    return apply_bitmask(logits, bitmask)


def _branch_state(seq: DraftSequence, depth: int, token: int) -> GrammarState | None:
    """A tree branch's own grammar state: the sequence's (after its bonus), advanced along the
    speculation's first ``depth`` tokens and the branch's fork token; None for a free sequence,
    or a branch the grammar does not allow (it answers an outcome that cannot happen)."""
    if seq.grammar is None:
        return None
    state = seq.grammar.fork()
    path = seq.last_spec[:depth] + [token]
    return state if state.advance(path) == len(path) else None


@dataclass
class _Chain:
    """One row's just-in-time draft: its tokens, each one's q' row (None where the row is greedy
    or the token was forced), which tokens the grammar forced, and the tokens not yet written to
    the KV."""

    pending: list[int]
    tokens: list[int] = field(default_factory=list)
    probs: list[torch.Tensor | None] = field(default_factory=list)
    forced: list[bool] = field(default_factory=list)

    def add(self, token: int, q: torch.Tensor | None, forced: bool = False) -> None:
        self.tokens.append(token)
        self.probs.append(q)
        self.forced.append(forced)
        self.pending.append(token)

    def take_pending(self) -> list[int]:
        out, self.pending = self.pending, []
        return out


def _stack(steps: list[tuple[torch.Tensor, torch.Tensor | None]]) -> Drafts:
    tokens = torch.stack([tok for tok, _ in steps], dim=1)
    probs = None if steps[0][1] is None else torch.stack([q for _, q in steps], dim=1)
    return Drafts(tokens, probs)


def _stream_seed(seed: int, key: tuple[int, int, int]) -> int:
    """A 63-bit seed for the draft's stream of one outcome: a hash, never an offset of the
    request's seed (seed + 1 would be the next request's target stream)."""
    digest = hashlib.blake2b(repr((seed, "draft") + tuple(key)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1
