"""Sampling parameters and the one map from target logits to the processed distribution p.

Plain autoregressive sampling, speculative verification (trtssd.spec_decode.verify) and the draft all
call :func:`processed_probs`, so "the distribution the target samples from" has exactly one
definition. Randomness always comes from per-row ``torch.Generator`` objects (None = torch's
global RNG), so a seeded request draws the same numbers whatever else is in its batch.

Penalties, ``bad_words_ids`` and ``min_tokens`` depend on the tokens before each position, which a
`History` per row gives: position i of a row follows its prompt, its output and the first i tokens
of its ``chain`` (the proposals before i in a verify, the tokens a row's logprobs score). The
counts "up to position i" are computed here only (`_counts`), so that p at every position of a
verify chain is the distribution plain decoding would have sampled that token from.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import math
from dataclasses import dataclass
from typing import Mapping, Sequence, Union

import torch

from trtssd.structured.constraint import Constraint

# What callers may pass as the source of randomness for a batch of rows:
#   None                       -> every row uses torch's global RNG,
#   a torch.Generator          -> every row draws from that one generator (tests, benchmarks),
#   a sequence (one per row)   -> row i draws from generators[i] (None entries = global RNG).
Generators = Union[None, torch.Generator, Sequence[Union[torch.Generator, None]]]

_MAX_SEED = 2**63 - 1
MAX_LOGPROBS = 20  # most alternatives per token a request may ask for (OpenAI's and vLLM's limit)
# Most samples one request may ask for (SamplingParams.n). They run together, so a server also
# refuses n above its running batch (TargetLoop.check_request).
MAX_N = 128
# A temperature this small is greedy in all but name, and far smaller ones divide logits past
# float32's range (5e-324 rounds to 0): NaN, not sampling. 0 asks for greedy.
MIN_TEMPERATURE = 1e-6
MAX_PENALTY = 2.0  # presence_penalty and frequency_penalty lie in [-2, 2] (OpenAI's range)
# repetition_penalty lies in [1/100, 100]: dividing a logit by a smaller one (or multiplying by a
# larger one) overflows float32 to +-inf after temperature, and +inf logits make p NaN.
MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY = 0.01, 100.0
MAX_LOGIT_BIAS = 100.0  # a logit_bias value lies in [-100, 100] (OpenAI's range)


class FieldError(ValueError):
    """A request's value that cannot be served; ``field`` names the request field at fault."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


def _fail(field: str, allowed: str, value: object) -> None:
    raise FieldError(field, f"SamplingParams.{field} must be {allowed}, got {value!r}")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples. Validated on construction; never mutated afterwards.

    Processing order, at every position (as vLLM and Hugging Face ``generate`` order them):

    1. the constraint's mask (tokens it forbids at -inf);
    2. ``logit_bias`` added;
    3. ``bad_words_ids``: a word's last token at -inf where the text before the position ends
       with the word's other tokens (always, for a one-token word);
    4. ``min_tokens``: EOS (unless ``ignore_eos``) and ``stop_token_ids`` at -inf while the output
       before the position is shorter than ``min_tokens``;
       a position where steps 3 and 4 together would ban every token the constraint allows keeps
       the logits of step 2 (so there is always a token to sample: never a NaN distribution);
    5. ``repetition_penalty`` (Hugging Face's) on every token of the prompt and the output so far:
       a logit x > 0 becomes x / r, any other x * r;
    6. ``frequency_penalty`` * count and ``presence_penalty`` * [count > 0] subtracted, count being
       the token's occurrences in the output so far (OpenAI's definitions; the prompt is not counted);
    7. temperature, top-k, top-p, min-p. A greedy row takes the argmax after step 6.
    """

    temperature: float = 1.0  # softmax temperature; 0 = greedy (argmax), the others are then unused
    top_k: int = 0  # keep the k most likely tokens (ties with the k-th kept too); 0 = off
    top_p: float = 1.0  # keep the smallest most-likely set with mass >= top_p; 1 = off
    min_p: float = 0.0  # drop tokens with prob < min_p * (max prob); 0 = off
    max_tokens: int = 128  # most tokens generated for the request
    stop: tuple[str, ...] = ()  # stop when the output text contains one of these strings
    stop_token_ids: tuple[int, ...] = ()  # stop after emitting one of these tokens (besides EOS)
    ignore_eos: bool = False  # keep generating past EOS (benchmarks with fixed output length)
    seed: int | None = None  # per-request RNG seed; None = torch's global RNG (not reproducible)
    # Each emitted token's log-probability and this many most likely alternatives (0-20), from
    # `processed_logprobs`; None = off.
    logprobs: int | None = None
    # Each prompt token's log-probability (the first's is None: nothing scores it) and this many
    # most likely alternatives (0-20), from the same distribution as `logprobs`; None = off.
    prompt_logprobs: int | None = None
    # The language the output must belong to (a JSON schema, any JSON object, a regex, a choice, a
    # grammar: trtssd.structured); every distribution is masked by it first. None = free text.
    constraint: Constraint | None = None
    # Independent samples of the prompt (1-MAX_N), sharing its one prefill: sample j draws from
    # its own RNG, seeded `sample_seed(seed, j)` (sample 0 is the request without n).
    n: int = 1
    # Steps 2-6 of the processing order; each default is "off".
    presence_penalty: float = 0.0  # in [-2, 2]: subtracted once from each token the output holds
    frequency_penalty: float = 0.0  # in [-2, 2]: subtracted once per occurrence in the output
    repetition_penalty: float = 1.0  # in [0.01, 100]: on the tokens of the prompt and output; 1 = off
    # (token id, bias in [-100, 100]) pairs added to the logits, by id; a {id: bias} mapping is
    # accepted. Ids must lie in the vocabulary (checked at admission, where it is known).
    logit_bias: tuple[tuple[int, float], ...] = ()
    # Token sequences the output never completes (Hugging Face's bad_words_ids; TensorRT-LLM's
    # bad_words once tokenized), matched against the prompt and output before each position.
    bad_words_ids: tuple[tuple[int, ...], ...] = ()
    min_tokens: int = 0  # no EOS or stop token before the output has this many (0..max_tokens)

    def __post_init__(self) -> None:
        # Lists are accepted for convenience; stored as tuples so the object stays hashable.
        for name in ("stop", "stop_token_ids"):
            value = getattr(self, name)
            if isinstance(value, list):
                object.__setattr__(self, name, tuple(value))
        self._normalise_adjustments()
        if not _is_real(self.temperature) or not (self.temperature == 0 or self.temperature >= MIN_TEMPERATURE):
            _fail("temperature", f"0 (greedy) or a finite number >= {MIN_TEMPERATURE}", self.temperature)
        if not _is_int(self.top_k) or self.top_k < 0:
            _fail("top_k", "an int >= 0 (0 = off)", self.top_k)
        if not _is_real(self.top_p) or not 0 < self.top_p <= 1:
            _fail("top_p", "a number in (0, 1] (1 = off)", self.top_p)
        if not _is_real(self.min_p) or not 0 <= self.min_p < 1:
            _fail("min_p", "a number in [0, 1) (0 = off)", self.min_p)
        # 0: the prompt is only prefilled (for its prompt_logprobs), nothing is generated.
        if not _is_int(self.max_tokens) or self.max_tokens < 0:
            _fail("max_tokens", "an int >= 0", self.max_tokens)
        if not isinstance(self.stop, tuple) or not all(isinstance(s, str) and s for s in self.stop):
            _fail("stop", "a tuple/list of non-empty strings", self.stop)
        if not isinstance(self.stop_token_ids, tuple) or not all(
            _is_int(t) and t >= 0 for t in self.stop_token_ids
        ):
            _fail("stop_token_ids", "a tuple/list of ints >= 0", self.stop_token_ids)
        if not isinstance(self.ignore_eos, bool):
            _fail("ignore_eos", "a bool", self.ignore_eos)
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed <= _MAX_SEED):
            _fail("seed", f"None or an int in [0, {_MAX_SEED}]", self.seed)
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or not 0 <= value <= MAX_LOGPROBS):
                _fail(name, f"None or an int in [0, {MAX_LOGPROBS}]", value)
        if self.constraint is not None and not isinstance(self.constraint, Constraint):
            _fail("constraint", "None or a trtssd.Constraint", self.constraint)
        if not _is_int(self.n) or not 1 <= self.n <= MAX_N:
            _fail("n", f"an int in [1, {MAX_N}]", self.n)
        if self.constraint is not None and self.ignore_eos:
            # A constrained output ends where its grammar does (the grammar then allows only EOS).
            raise FieldError("ignore_eos", "SamplingParams.ignore_eos cannot be combined with a constraint: "
                                           "the output ends where the constraint's grammar does")
        self._check_adjustments()

    def _normalise_adjustments(self) -> None:
        """logit_bias as (id, bias) pairs sorted by id, bad_words_ids as tuples (hashable)."""
        bias = self.logit_bias
        if isinstance(bias, Mapping):
            bias = tuple(bias.items())
        if isinstance(bias, (list, tuple)) and all(isinstance(e, (list, tuple)) and len(e) == 2 for e in bias):
            pairs = tuple((e[0], e[1]) for e in bias)
            if all(_is_int(t) for t, _ in pairs):
                object.__setattr__(self, "logit_bias", tuple(sorted(pairs)))
        words = self.bad_words_ids
        if isinstance(words, (list, tuple)) and all(isinstance(w, (list, tuple)) for w in words):
            object.__setattr__(self, "bad_words_ids", tuple(tuple(w) for w in words))

    def _check_adjustments(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_real(value) or not -MAX_PENALTY <= value <= MAX_PENALTY:
                _fail(name, f"a number in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}] (0 = off)", value)
        if not _is_real(self.repetition_penalty) or not (
                MIN_REPETITION_PENALTY <= self.repetition_penalty <= MAX_REPETITION_PENALTY):
            _fail("repetition_penalty", f"a number in [{MIN_REPETITION_PENALTY:g}, {MAX_REPETITION_PENALTY:g}] "
                                        "(1 = off)", self.repetition_penalty)
        bias = self.logit_bias
        if not (isinstance(bias, tuple) and all(isinstance(e, tuple) and len(e) == 2 and _is_int(e[0]) and e[0] >= 0
                                                and _is_real(e[1]) for e in bias)):
            _fail("logit_bias", "a {token id: bias} mapping (ids ints >= 0, biases finite numbers)", bias)
        outside = [(t, b) for t, b in bias if not -MAX_LOGIT_BIAS <= b <= MAX_LOGIT_BIAS]
        if outside:
            _fail("logit_bias", f"a mapping of token ids to biases in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]",
                  dict(outside[:5]))
        ids = [t for t, _ in bias]
        if len(set(ids)) != len(ids):
            _fail("logit_bias", "a mapping with each token id once", bias)
        if not all(isinstance(w, tuple) and w and all(_is_int(t) and t >= 0 for t in w) for w in self.bad_words_ids):
            _fail("bad_words_ids", "a tuple/list of non-empty token id sequences (ints >= 0)", self.bad_words_ids)
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            _fail("min_tokens", f"an int in [0, max_tokens = {self.max_tokens}]", self.min_tokens)
        if self.constraint is not None and self.min_tokens:
            # The grammar may allow nothing but EOS before min_tokens: the two cannot both hold.
            raise FieldError("min_tokens", "SamplingParams.min_tokens cannot be combined with a constraint: the "
                                           "output ends where the constraint's grammar does")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0

    @property
    def seeded_sampling(self) -> bool:
        """A sampled request with a seed: it promises the same output at any load, so every
        logit it is sampled or verified with must keep its bits (no prefill split that rounds
        differently, no plain round where it would have speculated)."""
        return self.seed is not None and not self.is_greedy

    def for_sample(self, index: int) -> "SamplingParams":
        """Sample ``index`` of an ``n``-sample request as a request of its own: n = 1 and the
        sample's seed (`sample_seed`), every other field as given."""
        if not _is_int(index) or not 0 <= index < self.n:
            raise ValueError(f"sample index must be an int in [0, {self.n}); got {index!r}")
        seed = None if self.seed is None else sample_seed(self.seed, index)
        return dataclasses.replace(self, n=1, seed=seed)

    @property
    def adjusts_logits(self) -> bool:
        """Whether steps 2-6 of the processing order change anything (then p needs a `History`)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1
                    or self.logit_bias or self.bad_words_ids or self.min_tokens)

    def vocabulary_errors(self, vocab_size: int) -> FieldError | None:
        """The first token id of logit_bias, bad_words_ids or stop_token_ids outside [0,
        vocab_size), as the error admission raises; None when all lie inside. (A stop token id
        past the vocabulary would index past the logits where min_tokens holds stop tokens back.)"""
        for field, ids in (("logit_bias", [t for t, _ in self.logit_bias]),
                           ("bad_words_ids", [t for w in self.bad_words_ids for t in w]),
                           ("stop_token_ids", list(self.stop_token_ids))):
            bad = sorted({t for t in ids if t >= vocab_size})
            if bad:
                return FieldError(field, f"SamplingParams.{field} token ids must be in [0, {vocab_size}) (the "
                                         f"model's vocabulary); got {bad[:5]}")
        return None


@dataclass(frozen=True)
class History:
    """The tokens before a row's positions, as penalties, bad words and min_tokens read them.

    Position i of a row's logits [n, V] follows ``prompt + output + chain[:i]``. ``scoring_prompt``:
    the chain continues the prompt (prompt logprobs score each prompt token as the first output
    token after the prompt before it), so its tokens count as prompt, not as output.
    """

    prompt: Sequence[int]
    output: Sequence[int] = ()
    eos_token_ids: tuple[int, ...] = ()  # the model's end tokens, which min_tokens holds back (unless ignore_eos)
    chain: Sequence[int] = ()
    scoring_prompt: bool = False

    def along(self, chain: Sequence[int]) -> "History":
        """The same history with ``chain`` after it, position by position."""
        return dataclasses.replace(self, chain=chain)

    def held_back(self, params: SamplingParams) -> list[int]:
        """The tokens min_tokens masks: the stop tokens, EOS among them unless ignore_eos."""
        eos = () if params.ignore_eos else self.eos_token_ids
        return sorted(set(eos) | set(params.stop_token_ids))


Histories = Union[None, Sequence[Union[History, None]]]


def sample_seed(seed: int, index: int) -> int:
    """Sample ``index``'s seed in a request seeded ``seed``: the seed itself for sample 0 (so
    n = 1 draws what it always drew), else a 63-bit hash of (seed, index). A hash, never an
    offset: seed + 1 would be sample 0 of the request seeded seed + 1."""
    if index == 0:
        return seed
    digest = hashlib.blake2b(repr((seed, "sample", index)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


@dataclass(frozen=True)
class SamplingTensors:
    """Per-row sampling settings of a batch as tensors (one row per request)."""

    temperature: torch.Tensor  # [B] fp32; 1.0 on greedy rows (never divided by 0)
    top_k: torch.Tensor  # [B] long, 0 = off
    top_p: torch.Tensor  # [B] fp32
    min_p: torch.Tensor  # [B] fp32
    greedy: torch.Tensor  # [B] bool
    needs_sort: bool  # some non-greedy row uses top-k or top-p (the only steps needing a sort)
    needs_min_p: bool

    @classmethod
    def from_params(
        cls, params: Sequence[SamplingParams], device: torch.device | str = "cpu"
    ) -> "SamplingTensors":
        greedy = [p.is_greedy for p in params]
        temperature = [1.0 if g else p.temperature for p, g in zip(params, greedy)]
        top_k = [0 if g else p.top_k for p, g in zip(params, greedy)]
        top_p = [1.0 if g else p.top_p for p, g in zip(params, greedy)]
        min_p = [0.0 if g else p.min_p for p, g in zip(params, greedy)]
        return cls(
            temperature=torch.tensor(temperature, dtype=torch.float32, device=device),
            top_k=torch.tensor(top_k, dtype=torch.long, device=device),
            top_p=torch.tensor(top_p, dtype=torch.float32, device=device),
            min_p=torch.tensor(min_p, dtype=torch.float32, device=device),
            greedy=torch.tensor(greedy, dtype=torch.bool, device=device),
            needs_sort=any(k > 0 for k in top_k) or any(p < 1.0 for p in top_p),
            needs_min_p=any(m > 0 for m in min_p),
        )


def processed_probs(logits: torch.Tensor, params: Sequence[SamplingParams], history: Histories = None) -> torch.Tensor:
    """Raw logits [B, n, V] (or [B, V]) -> the processed distribution p, fp32, same shape.

    Row b uses ``params[b]`` at all its n positions, and ``history[b]`` for what came before
    each (needed by a row whose params `adjusts_logits`; None otherwise). Greedy rows give a
    one-hot at the argmax of the adjusted logits (first index on ties, as ``torch.argmax``).
    """
    if logits.dim() == 2:
        return processed_probs(logits[:, None, :], params, history)[:, 0, :]
    x, st = _processed_logits(logits, params, history)
    p = torch.softmax(x, dim=-1)
    if bool(st.greedy.any()):
        # A greedy row's x is its adjusted logits (temperature 1, nothing truncated).
        one_hot = torch.zeros_like(p).scatter_(-1, x.argmax(dim=-1, keepdim=True), 1.0)
        p = torch.where(st.greedy[:, None, None], one_hot, p)
    return p


def processed_logprobs(logits: torch.Tensor, params: Sequence[SamplingParams], history: Histories = None) -> torch.Tensor:
    """Raw logits [B, n, V] (or [B, V]) -> log p, fp32, same shape: the log of `processed_probs`
    (-inf outside top-k / top-p / min-p). A greedy row's p is a point mass, so its row gives the
    log-softmax of its adjusted logits instead (the raw ones when nothing adjusts them): the
    distribution greedy decoding takes the argmax of (vLLM's default too)."""
    if logits.dim() == 2:
        return processed_logprobs(logits[:, None, :], params, history)[:, 0, :]
    x, _ = _processed_logits(logits, params, history)  # greedy rows: the adjusted logits, nothing truncated
    return torch.log_softmax(x, dim=-1)


def greedy_tokens(logits: torch.Tensor, params: Sequence[SamplingParams], history: Histories = None) -> torch.Tensor:
    """Logits [B, V] -> [B] the argmax of each row's adjusted logits: what sampling its one-hot p
    would return, without building p (on a small model the softmax and CDF cost a tenth of a step)."""
    return adjusted_logits(logits[:, None, :], params, history)[:, 0, :].argmax(dim=-1)


def adjusted_logits(logits: torch.Tensor, params: Sequence[SamplingParams], history: Histories = None) -> torch.Tensor:
    """Raw logits [B, n, V] -> fp32 logits after steps 2-6 of the processing order (SamplingParams):
    logit bias, bad words, min_tokens and the penalties, each position with the counts of the
    tokens before it. Rows whose params adjust nothing cost nothing: where no row does, the
    result is ``logits.float()`` (the input itself when it is fp32)."""
    x = logits.float()
    rows = [b for b, p in enumerate(params) if p.adjusts_logits]
    if not rows:
        return x
    if history is None or len(history) != len(params):
        raise ValueError("rows whose SamplingParams adjust the logits (penalties, logit_bias, bad_words_ids, "
                         "min_tokens) need one History per row")
    x = x.clone() if x.data_ptr() == logits.data_ptr() else x
    for b in rows:
        if history[b] is None:
            raise ValueError(f"row {b}'s SamplingParams adjust its logits but its History is None")
        x[b] = _adjusted_row(x[b], params[b], history[b])
    return x


def _adjusted_row(x: torch.Tensor, params: SamplingParams, history: History) -> torch.Tensor:
    """One row's logits [n, V] (fp32) after steps 2-6. Every step is elementwise, so a position
    gets the same bits whichever rows and positions share its call (plain step or verify chain)."""
    n, vocab = x.shape
    if params.logit_bias:
        x = x + _bias_vector(params.logit_bias, vocab, str(x.device))
    x = _banned(x, params, history)
    penalty = params.repetition_penalty
    if penalty != 1 or params.frequency_penalty or params.presence_penalty:
        prompt_counts, output_counts = _counts(history, n, vocab, x.device)
        if penalty != 1:
            seen = (prompt_counts > 0) | (output_counts > 0)
            x = torch.where(seen, torch.where(x > 0, x / penalty, x * penalty), x)
        if params.frequency_penalty:
            x = x - params.frequency_penalty * output_counts
        if params.presence_penalty:
            x = x - params.presence_penalty * (output_counts > 0).float()
    return x


def _banned(x: torch.Tensor, params: SamplingParams, history: History) -> torch.Tensor:
    """Steps 3 and 4 on logits [n, V]: bad words' and held-back stop tokens at -inf, except at a
    position where that would leave no token (the words and stop tokens cover all the constraint
    allows): there it keeps ``x`` as it was, so p always has mass. Per position, so a verify chain
    keeps a plain step's bits."""
    n, vocab = x.shape
    ban = torch.zeros(n, vocab, dtype=torch.bool, device=x.device)
    if params.bad_words_ids:
        ban |= _bad_word_mask(params.bad_words_ids, history, n, vocab, x.device)
    if params.min_tokens:
        ban |= _held_back_mask(params, history, n, vocab, x.device)
    if not bool(ban.any()):
        return x
    nothing_left = (ban | (x == -math.inf)).all(dim=-1, keepdim=True)
    return x.masked_fill(ban & ~nothing_left, -math.inf)


def _counts(history: History, n: int, vocab: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """([n, V], [n, V]) fp32: each token's occurrences in the prompt and in the output before each
    of the n positions: the history's own, plus the chain's tokens before the position (a
    cumulative sum over the chain), counted as prompt where the history scores the prompt."""
    chain = torch.as_tensor(list(history.chain[:n - 1]), dtype=torch.long, device=device)
    steps = torch.zeros(n, vocab, device=device)
    steps[torch.arange(1, len(chain) + 1, device=device), chain] = 1.0
    along = steps.cumsum(dim=0)  # row i: the chain's first i tokens

    def bincount(tokens: Sequence[int]) -> torch.Tensor:
        ids = torch.as_tensor(list(tokens), dtype=torch.long, device=device)
        return torch.bincount(ids, minlength=vocab).float()[None, :vocab]

    prompt, output = bincount(history.prompt), bincount(history.output)
    if history.scoring_prompt:
        return prompt + along, output.expand(n, vocab)
    return prompt.expand(n, vocab), output + along


def _held_back_mask(params: SamplingParams, history: History, n: int, vocab: int, device) -> torch.Tensor:
    """[n, V] bool: the stop tokens at the positions where the output before them is shorter than
    min_tokens (a chain that scores the prompt adds no output)."""
    before = len(history.output) + (0 if history.scoring_prompt else torch.arange(n, device=device))
    short = torch.as_tensor(before, device=device).expand(n) < params.min_tokens
    held = torch.zeros(vocab, dtype=torch.bool, device=device)
    held[history.held_back(params)] = True
    return short[:, None] & held[None, :]


def _bad_word_mask(words: tuple[tuple[int, ...], ...], history: History, n: int, vocab: int, device) -> torch.Tensor:
    """[n, V] bool: at position i, the last token of every word whose other tokens end the text
    before i (prompt, output, chain[:i]); a one-token word everywhere."""
    mask = torch.zeros(n, vocab, dtype=torch.bool, device=device)
    reach = max(len(w) for w in words) - 1  # the most tokens a word looks back
    tail = list(history.output[len(history.output) - reach:]) if reach else []
    if len(tail) < reach:
        tail = list(history.prompt[len(history.prompt) - (reach - len(tail)):]) + tail
    for i in range(n):
        text = tail + list(history.chain[:i])
        for word in words:
            before = list(word[:-1])
            if not before or text[len(text) - len(before):] == before:
                mask[i, word[-1]] = True
    return mask


@functools.lru_cache(maxsize=64)
def _bias_vector(bias: tuple[tuple[int, float], ...], vocab: int, device: str) -> torch.Tensor:
    """logit_bias as a dense [V] fp32 vector (kept per request's bias: it is added every step)."""
    out = torch.zeros(vocab, device=device)
    out[[t for t, _ in bias]] = torch.tensor([b for _, b in bias], dtype=torch.float32, device=device)
    return out


@dataclass(frozen=True)
class TokenLogprob:
    """One emitted token's log-probability and the most likely tokens at its position."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # (token id, logprob), most likely first; only tokens with p > 0
    rank: int = 1  # 1 + how many tokens are more likely than it (vLLM's "rank")


def token_logprobs(logits: torch.Tensor, tokens: Sequence[int], params: SamplingParams,
                   num_top: int | None = None, history: History | None = None) -> list[TokenLogprob]:
    """Logits [n, V] scoring each of ``tokens`` (n of them) -> their `TokenLogprob`s, with
    ``num_top`` alternatives each (default ``params.logprobs``; prompt logprobs pass
    ``params.prompt_logprobs``). ``history``: what came before the first token (token i follows
    it and ``tokens[:i]``); needed where the params adjust the logits."""
    num_top = params.logprobs if num_top is None else num_top
    chained = None if history is None else [history.along(list(tokens))]
    logp = processed_logprobs(logits[None], [params], chained)[0]  # [n, V]
    chosen_t = logp.gather(-1, torch.as_tensor(list(tokens), dtype=torch.long)[:, None])  # [n, 1]
    ranks = ((logp > chosen_t).sum(dim=-1) + 1).tolist()
    chosen = chosen_t[:, 0].tolist()
    top_values = top_ids = None
    if num_top:
        top_values, top_ids = logp.topk(num_top, dim=-1)
    out = []
    for i, (tok, lp) in enumerate(zip(tokens, chosen)):
        top = () if top_ids is None else tuple(
            (t, v) for t, v in zip(top_ids[i].tolist(), top_values[i].tolist()) if v != -math.inf)
        out.append(TokenLogprob(int(tok), lp, top, int(ranks[i])))
    return out


def prompt_logprobs(logits: torch.Tensor, prompt: Sequence[int], params: SamplingParams,
                    eos_token_ids: tuple[int, ...] = ()) -> list[TokenLogprob | None]:
    """A prompt's logprobs from its prefill's logits [len(prompt), V] (row i scores token i + 1):
    one per prompt token, the first None (nothing before it scores it). Each is processed as the
    first output token after the prompt before it would be (`History.scoring_prompt`)."""
    if len(prompt) < 2:
        return [None] * len(prompt)
    history = History(prompt[:1], eos_token_ids=eos_token_ids, scoring_prompt=True) if params.adjusts_logits else None
    return [None, *token_logprobs(logits[:-1], prompt[1:], params, num_top=params.prompt_logprobs, history=history)]


def _processed_logits(logits: torch.Tensor, params: Sequence[SamplingParams],
                      history: Histories = None) -> tuple[torch.Tensor, "SamplingTensors"]:
    """Raw logits [B, n, V] -> adjusted (`adjusted_logits`), temperature-scaled logits with the
    tokens top-k, top-p and min-p drop at -inf (greedy rows: the adjusted logits), and the batch's
    SamplingTensors."""
    if logits.dim() != 3:
        raise ValueError(f"logits must have shape [B, n, V] or [B, V], got {tuple(logits.shape)}")
    if len(params) != logits.shape[0]:
        raise ValueError(f"params has {len(params)} entries but logits has {logits.shape[0]} rows")
    st = SamplingTensors.from_params(params, logits.device)
    x = adjusted_logits(logits, params, history) / st.temperature[:, None, None]
    keep = torch.ones_like(x, dtype=torch.bool)
    if st.needs_sort:
        keep = _top_k_top_p_keep(x, st.top_k, st.top_p)
    if st.needs_min_p:
        probs = torch.softmax(x.masked_fill(~keep, -math.inf), dim=-1)
        # min-p is relative to the max, which renormalisation does not change.
        threshold = st.min_p[:, None, None] * probs.amax(dim=-1, keepdim=True)
        keep &= probs >= threshold
    return x.masked_fill(~keep, -math.inf), st


def _top_k_top_p_keep(x: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask [B, n, V] of tokens surviving top-k then top-p (per-row k and p)."""
    vocab = x.shape[-1]
    # A stable sort makes the top-p boundary among equal logits deterministic (lower id first).
    sorted_x, order = torch.sort(x, dim=-1, descending=True, stable=True)
    keep_sorted = torch.ones_like(sorted_x, dtype=torch.bool)
    k = torch.where(top_k > 0, top_k, vocab).clamp(max=vocab)  # k >= V means "keep all"
    kth = sorted_x.gather(-1, (k - 1)[:, None, None].expand(-1, x.shape[1], 1))
    keep_sorted &= sorted_x >= kth
    probs = torch.softmax(sorted_x.masked_fill(~keep_sorted, -math.inf), dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs  # mass of the strictly more likely tokens
    # Always keeps the most likely token. Rows without top-p skip the test: their rounded
    # cumulative mass can reach 1.0 before the tail, which would cut tokens off.
    top_p = top_p[:, None, None]
    keep_sorted &= (mass_before < top_p) | (top_p >= 1)
    keep_sorted[..., 0] = True  # also where top_p is below float32's smallest number
    return torch.zeros_like(keep_sorted).scatter_(-1, order, keep_sorted)


def make_generator(
    params: SamplingParams, device: torch.device | str = "cpu"
) -> torch.Generator | None:
    """The request's own RNG when it has a seed; None means torch's global RNG."""
    if params.seed is None:
        return None
    return torch.Generator(device=device).manual_seed(params.seed)


def draw_uniforms(
    generators: Generators, rows: int, cols: int, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """Uniform [0, 1) float64 numbers [rows, cols]; row i draws its ``cols`` from its generator.

    float64, because fp32 uniforms lie on a 2^-24 grid, which misplaces the mass of the many tiny
    probabilities of a large vocabulary (~5e-4 total variation at V = 49152).

    Rows sharing torch's global RNG are drawn in one call; each seeded row costs one small call,
    so a seeded row consumes exactly ``cols`` numbers whatever the batch looks like.
    """
    if generators is None or isinstance(generators, torch.Generator):
        return torch.rand(rows, cols, generator=generators, device=device, dtype=torch.float64)
    if len(generators) != rows:
        raise ValueError(f"generators has {len(generators)} entries, expected one per row ({rows})")
    out = torch.empty(rows, cols, device=device, dtype=torch.float64)
    unseeded = [i for i, g in enumerate(generators) if g is None]
    if unseeded:
        out[unseeded] = torch.rand(len(unseeded), cols, device=device, dtype=torch.float64)
    for i, g in enumerate(generators):
        if g is not None:
            out[i] = torch.rand(cols, generator=g, device=device, dtype=torch.float64)
    return out


def sample_with_uniforms(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling: probs [..., V] (need not sum to 1), u [...] in [0, 1) -> ids [...].

    Returns the first token whose cumulative mass exceeds u * total, so a zero-probability token
    is never returned (its cumulative mass equals its predecessor's).

    The CDF is summed in float64: in fp32 each token's increment is rounded to the ulp of the
    running sum (~6e-8 near 0.5), which at V = 49152 (masses ~2e-5) moves the boundaries between
    tokens by ~3e-4 of the mass in all. u should be float64 (`draw_uniforms`' are): fp32
    uniforms lie on a 2^-24 grid, which by itself limits each token's probability to a multiple
    of 2^-24.
    """
    cdf = probs.double().cumsum(dim=-1)
    target = (u.double() * cdf[..., -1])[..., None]
    idx = torch.searchsorted(cdf.contiguous(), target.contiguous(), right=True)[..., 0]
    # u * total can round up to total; fall back to the last token with mass in that case.
    vocab = probs.shape[-1]
    last_nonzero = vocab - 1 - (probs > 0).flip(-1).to(torch.uint8).argmax(dim=-1)
    return torch.minimum(idx, last_nonzero)


def sample(probs: torch.Tensor, generators: Generators = None) -> torch.Tensor:
    """One token per row from probs [B, V], row i using generators[i]. Returns [B] long."""
    if probs.dim() != 2:
        raise ValueError(f"probs must have shape [B, V], got {tuple(probs.shape)}")
    u = draw_uniforms(generators, probs.shape[0], 1, probs.device)[:, 0]
    return sample_with_uniforms(probs, u)
