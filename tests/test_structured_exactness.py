"""Speculation under a grammar is exact: the output has the grammar-masked target distribution at
every position, whatever proposed the tokens (a masked draft, an unmasked one, the grammar's
forced tokens), and a mutant that masks the whole chain with one mask is caught.

The language: a 7-token vocabulary (a, b, c, d, e, ea, EOS) and the grammar ``item+`` with
items "a", "bc", "dea". After "b" the grammar forces "c"; after "d" it forces the text "ea", which
two token sequences spell (ea, or e then a): a forced string is not a forced token sequence. The
target is a Markov chain over the tokens (its next-token logits depend on the previous token), so
plain constrained sampling has an exact distribution, enumerated here with the real grammar
state: P(x_1..x_n) = prod_t softmax(mask_t(logits[x_{t-1}]))[x_t], each mask_t from the state
after x_1..x_{t-1}. EOS has no mass (the documents never end within the K + 1 positions).

The statistics are tests/exact_chain.py's: exact binomial tails per cell, Bonferroni at 1e-5.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from exact_chain import check_counts
from trtssd.sampling import SamplingParams, draw_uniforms, processed_probs, sample_with_uniforms
from trtssd.spec_decode.verify import verify
from trtssd.structured.constraint import Constraint
from trtssd.structured.grammar import Grammars, apply_bitmask, chain_bitmask, new_bitmask

VOCAB = ["a", "b", "c", "d", "e", "ea", "<eos>"]
V = len(VOCAB)
EOS = 6
K = 3
X0 = 0  # the token before the output ("a": the target's context)
GRAMMAR = Constraint.grammar('root ::= item+\nitem ::= "a" | "bc" | "dea"')
N = 40_000
MUTANT_ROWS = 5_000  # the mutant emits ungrammatical tokens: a few thousand rows show it


class RawTokenizer:
    """Greedy longest-match encoding over VOCAB (what the grammar's forced text is proposed as)."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        ids, i = [], 0
        while i < len(text):
            tok = max((t for t, s in enumerate(VOCAB[:EOS]) if text.startswith(s, i)), key=lambda t: len(VOCAB[t]))
            ids.append(tok)
            i += len(VOCAB[tok])
        return ids


@pytest.fixture(scope="module")
def grammars() -> Grammars:
    import xgrammar as xgr

    info = xgr.TokenizerInfo(VOCAB, vocab_type=xgr.VocabType.RAW, stop_token_ids=[EOS])
    return Grammars(RawTokenizer(), V, [EOS], tokenizer_info=info)


def _tables(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Target and draft logits [V, V] (row = previous token); EOS never has mass."""
    g = torch.Generator().manual_seed(seed)
    target = 1.5 * torch.randn(V, V, generator=g)
    draft = target + 1.0 * torch.randn(V, V, generator=g)
    target[:, EOS] = draft[:, EOS] = -1e9
    return target, draft


def _masked_probs(logits: torch.Tensor, bitmask: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    return processed_probs(apply_bitmask(logits, bitmask)[None], [params])[0]


def exact_marginals(grammars: Grammars, target: torch.Tensor, params: SamplingParams, length: int):
    """Marginals of x_1..x_length and pairs (x_t, x_t+1) of plain constrained sampling."""
    marginals = torch.zeros(length, V, dtype=torch.float64)
    pairs = torch.zeros(length - 1, V * V, dtype=torch.float64)

    def walk(state, prefix: list[int], prob: float) -> None:
        t = len(prefix)
        if t == length:
            for i, x in enumerate(prefix):
                marginals[i, x] += prob
            for i in range(length - 1):
                pairs[i, prefix[i] * V + prefix[i + 1]] += prob
            return
        bitmask = new_bitmask(1, V)
        state.fill(bitmask, 0)
        p = _masked_probs(target[prefix[-1] if prefix else X0][None], bitmask, params)[0].double()
        for x in range(V):
            if p[x] > 0:
                assert state.accept(x)
                walk(state, prefix + [x], prob * float(p[x]))
                state.rollback(1)

    walk(grammars.start(GRAMMAR), [], 1.0)
    return marginals, pairs


def _draft_chain(state, draft: torch.Tensor, last: int, masked: bool, params: SamplingParams, u: torch.Tensor,
                 take_forced: bool = False):
    """K proposals sampled from the draft (masked by the grammar, or free), and their q rows.
    ``take_forced``: text the grammar forces is taken as its tokens with a one-hot q, as the draft
    rank's just-in-time chains do."""
    fork = state.fork()
    tokens, qs = [], []
    for d in range(K):
        if take_forced and len(tokens) < K:
            for tok in fork.forced_tokens(K - len(tokens)):
                assert fork.accept(tok)
                tokens.append(tok)
                qs.append(torch.nn.functional.one_hot(torch.tensor(tok), V).float())
                last = tok
        if len(tokens) == K:
            break
        bitmask = new_bitmask(1, V)
        if masked:
            fork.fill(bitmask, 0)
        q = _masked_probs(draft[last][None], bitmask, params)[0]
        tok = int(sample_with_uniforms(q[None], u[d:d + 1])[0])
        if masked:
            assert fork.accept(tok)
        tokens.append(tok)
        qs.append(q)
        last = tok
    return tokens, torch.stack(qs)


def simulate(grammars: Grammars, target: torch.Tensor, draft: torch.Tensor, params: SamplingParams,
             proposer: str, masks=chain_bitmask, seed: int = 0, rows: int | None = None) -> torch.Tensor:
    """Speculative rounds of N rows until each has K + 1 tokens -> [N, K + 1]. ``proposer``:
    "masked" or "free" draft (ratio rows), "forced" (the grammar's forced tokens as point
    masses where it forces text, else the masked draft), or "draft-forced" (a masked draft chain
    that takes forced text as one-hot q rows, as the draft rank's chains do). ``masks``: how the target's chain of
    masks is made (the real chain_bitmask, or a mutant)."""
    torch.manual_seed(seed)
    rows = rows or N
    states = [grammars.start(GRAMMAR) for _ in range(rows)]
    out = [[] for _ in range(rows)]
    active = list(range(rows))
    while active:
        draft_u = draw_uniforms(None, len(active), K)
        proposals, qs, counts, point_mass = [], [], [], []
        for j, r in enumerate(active):
            last = out[r][-1] if out[r] else X0
            forced = states[r].forced_tokens(K) if proposer == "forced" else []
            tokens, q = _draft_chain(states[r], draft, last, proposer != "free", params, draft_u[j],
                                     take_forced=proposer == "draft-forced")
            if forced:
                tokens = forced + [0] * (K - len(forced))
            proposals.append(tokens)
            qs.append(q)
            counts.append(len(forced) if forced else K)
            point_mass.append(bool(forced))
        logits = []
        for r, tokens, n in zip(active, proposals, counts):
            last = out[r][-1] if out[r] else X0
            chain = [last] + tokens[:n] + [0] * (K - n)
            row = target[torch.tensor(chain)]  # position i scores the token after chain[i]
            logits.append(apply_bitmask(row, masks(states[r], tokens[:n], K + 1, V)))
        result = verify(torch.stack(logits), torch.tensor(proposals), torch.tensor(counts), torch.stack(qs),
                        torch.tensor(point_mass), [params] * len(active), None)
        still = []
        for j, r in enumerate(active):
            n, bonus = int(result.num_accepted[j]), int(result.bonus[j])
            emitted = (proposals[j][:n] + [bonus])[:K + 1 - len(out[r])]
            out[r] += emitted
            states[r].advance(emitted)  # a mutant's illegal token stops the state: the check fails anyway
            if len(out[r]) < K + 1:
                still.append(r)
        active = still
    return torch.tensor(out)


def _check(grammars, target, params, samples):
    marginals, pairs = exact_marginals(grammars, target, params, K + 1)
    parts = [(f"x{t + 1}", samples[:, t], marginals[t]) for t in range(K + 1)]
    parts += [(f"(x{t + 1}, x{t + 2})", samples[:, t] * V + samples[:, t + 1], pairs[t]) for t in range(K)]
    return check_counts(parts)


def _one_mask_for_the_chain(state, tokens, rows, vocab):
    """The classic bug: the committed state's mask applied at every position of the chain."""
    bitmask = new_bitmask(rows, vocab)
    for i in range(rows):
        state.fill(bitmask, i)
    return bitmask


SAMPLED = SamplingParams(temperature=1.0)


@pytest.mark.slow
@pytest.mark.parametrize("proposer", ["masked", "free", "forced", "draft-forced"])
def test_sampled_speculation_has_the_masked_distribution_at_every_position(grammars, proposer):
    target, draft = _tables(1)
    check = _check(grammars, target, SAMPLED, simulate(grammars, target, draft, SAMPLED, proposer, seed=2))
    assert check.ok, check


@pytest.mark.slow
def test_one_mask_for_the_whole_chain_is_caught(grammars):
    target, draft = _tables(1)
    samples = simulate(grammars, target, draft, SAMPLED, "free", masks=_one_mask_for_the_chain, seed=3,
                       rows=MUTANT_ROWS)
    assert not _check(grammars, target, SAMPLED, samples).ok


@pytest.mark.slow
def test_the_exact_distribution_is_a_distribution_over_grammatical_outputs(grammars):
    """The enumeration itself: marginals sum to 1 and nothing ungrammatical has mass ("c" only
    after "b", "e"/"ea" only after "d")."""
    target, _ = _tables(1)
    marginals, pairs = exact_marginals(grammars, target, SAMPLED, K + 1)
    assert torch.allclose(marginals.sum(-1), torch.ones(K + 1, dtype=torch.float64))
    assert marginals[0, VOCAB.index("c")] == 0 and marginals[0, VOCAB.index("e")] == 0
    after_b = pairs[0].view(V, V)[VOCAB.index("b")]
    assert after_b[VOCAB.index("c")] == after_b.sum() > 0


def test_greedy_speculation_equals_constrained_greedy_decoding(grammars):
    """Temperature 0: every proposer gives plain constrained greedy's tokens."""
    greedy = SamplingParams(temperature=0)
    for seed in range(6):
        target, draft = _tables(seed)
        state, last, plain = grammars.start(GRAMMAR), X0, []
        for _ in range(K + 1):
            bitmask = new_bitmask(1, V)
            state.fill(bitmask, 0)
            last = int(apply_bitmask(target[last][None], bitmask)[0].argmax())
            plain.append(last)
            assert state.accept(last)
        for proposer in ("masked", "free", "forced", "draft-forced"):
            out = simulate(grammars, target, draft, greedy, proposer, seed=seed, rows=4)
            assert all(row == plain for row in out.tolist()), (seed, proposer)


def test_chain_masks_follow_the_proposals(grammars):
    """Row i of a chain's masks allows what may follow the proposals before i; a row after an
    illegal proposal allows everything; the state is left where it was."""
    state = grammars.start(GRAMMAR)
    bits = chain_bitmask(state, [VOCAB.index("b"), VOCAB.index("c"), VOCAB.index("c")], 4, V)
    allowed = [{VOCAB[t] for t in range(V) if (int(bits[i, 0]) >> t) & 1} for i in range(4)]
    assert allowed[0] == {"a", "b", "d"}
    assert allowed[1] == {"c"}
    assert allowed[2] == {"a", "b", "d", "<eos>"}
    assert allowed[3] == set(VOCAB)  # after the illegal second "c"
    assert state.forced_tokens(K) == []  # still at the start: a choice of items
    assert state.accept(VOCAB.index("d")) and state.forced_tokens(K) == [VOCAB.index("ea")]


def test_forced_tokens_stop_at_the_limit_and_at_a_choice(grammars):
    state = grammars.start(Constraint.grammar('root ::= "dea" ("a" | "bc")'))
    assert state.forced_tokens(1) == [VOCAB.index("d")]
    assert state.forced_tokens(K) == [VOCAB.index("d"), VOCAB.index("ea")]
    state.advance([VOCAB.index("d"), VOCAB.index("e"), VOCAB.index("a")])
    assert state.forced_tokens(K) == []
