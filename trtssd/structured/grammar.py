"""Constraints as token masks: the grammar engine (xgrammar) behind structured outputs.

`Grammars` compiles a `Constraint` for one tokenizer once and keeps the compiled grammar (a
bounded cache keyed by the constraint, shared by every request that sends the same one).
`GrammarState` follows one output token by token: which tokens may come next (a bitmask), the
text the grammar forces next, fork and rollback for speculation's branches and verify chains.

Why xgrammar: on Qwen2.5's 151,936-token vocabulary its next-token mask costs 1.8 us at the median
(47 us at p90) against llguidance's 24 us (136 us); a fork costs both about 3 us, and both roll
back (docs/bench/grammar-engine-mask-cost/results.json).

JSON is generated on one line with ", " and ": " between items (``JSON_SEPARATORS``): valid JSON,
the layout models write inline, and no optional whitespace, so the text between values (quotes,
keys, separators) is forced and can be proposed by the grammar itself.
"""

from __future__ import annotations

import json
import logging
import math
import re
import threading
from collections import OrderedDict
from typing import Any, Sequence

import torch

from trtssd.structured.constraint import Constraint, ConstraintError

log = logging.getLogger(__name__)

JSON_SEPARATORS = (", ", ": ")  # item and key separators of generated JSON
CACHE_SIZE = 64  # distinct compiled constraints kept (LRU)
ALL_ALLOWED = -1  # a bitmask word with every bit set


def _xgrammar():
    # Imported on first use: a process that never sees a constraint never loads it.
    import xgrammar

    return xgrammar


class Grammars:
    """Compiles constraints for one tokenizer; compiled grammars are cached (bounded, LRU) and
    shared by every request with the same constraint. Thread-safe: admission checks run on the
    server's thread, the loop starts states on its own."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int] | None = None,
                 cache_size: int = CACHE_SIZE, tokenizer_info: Any = None):
        """``tokenizer``: a transformers tokenizer, or a callable returning one (loaded at the
        first constraint: a process that never sees one never pays for it). ``stop_token_ids``:
        the tokens that end an output (None: the tokenizer's EOS); a finished grammar allows
        only them. ``tokenizer_info``: xgrammar's description of the vocabulary, where it is not
        a transformers tokenizer's (then ``tokenizer`` only needs ``encode``)."""
        self._info = tokenizer_info
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._stop_token_ids = stop_token_ids
        self._compiler = None
        self._cache: OrderedDict[Constraint, Any] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()

    @property
    def tokenizer(self) -> Any:
        if callable(self._tokenizer) and not hasattr(self._tokenizer, "encode"):
            self._tokenizer = self._tokenizer()
        if self._tokenizer is None:
            raise ConstraintError("this model has no tokenizer: constraints need one")
        return self._tokenizer

    def _compiler_once(self):
        with self._lock:
            if self._compiler is None:
                xgr = _xgrammar()
                info = self._info or self._tokenizer_info(xgr)
                self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
            return self._compiler

    def _tokenizer_info(self, xgr):
        tok = self.tokenizer
        stops = self._stop_token_ids
        if stops is None:
            stops = [] if tok.eos_token_id is None else [int(tok.eos_token_id)]
        return xgr.TokenizerInfo.from_huggingface(tok, vocab_size=self.vocab_size, stop_token_ids=list(stops) or None)

    def check(self, constraint: Constraint) -> None:
        """Raise ConstraintError saying what is wrong when the constraint cannot be compiled."""
        self.compile(constraint)

    def compile(self, constraint: Constraint):
        """The compiled grammar of a constraint (cached)."""
        with self._lock:
            found = self._cache.get(constraint)
            if found is not None:
                self._cache.move_to_end(constraint)
                return found
        compiled = self._compile(constraint)
        with self._lock:
            self._cache[constraint] = compiled
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return compiled

    def start(self, constraint: Constraint) -> "GrammarState":
        """A state at the start of an output."""
        return GrammarState(_xgrammar().GrammarMatcher(self.compile(constraint)), self)

    def _compile(self, c: Constraint):
        compiler = self._compiler_once()
        try:
            if c.kind == "json_schema":
                _check_schema(c.schema)
                return compiler.compile_json_schema(c.value, any_whitespace=False, separators=JSON_SEPARATORS,
                                                          strict_mode=True)
            if c.kind == "json_object":  # any object: properties unrestricted
                return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False,
                                                          separators=JSON_SEPARATORS, strict_mode=False)
            if c.kind == "regex":
                return compiler.compile_regex(c.value)
            if c.kind == "choice":
                return compiler.compile_grammar(choice_grammar(c.value))
            return compiler.compile_grammar(c.value)
        except ConstraintError:
            raise
        except Exception as err:  # noqa: BLE001 - xgrammar raises several types; the message is what matters
            raise ConstraintError(f"invalid {c.kind}: {_first_line(err)}") from None


def choice_grammar(options: Sequence[str]) -> str:
    """An EBNF grammar whose language is exactly ``options``."""
    return "root ::= " + " | ".join(json.dumps(o, ensure_ascii=False) for o in options)


def _check_schema(schema: Any) -> None:
    """A JSON schema must be one by its own meta-schema (jsonschema), before xgrammar reads it."""
    if schema is True:
        return
    import jsonschema

    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as err:
        where = "/".join(str(p) for p in err.absolute_path) or "(root)"
        raise ConstraintError(f"invalid json_schema at {where}: {err.message}") from None


def _first_line(err: Exception) -> str:
    """The error's first line without xgrammar's log prefix ("[hh:mm:ss] /path/file.cc:94: ")."""
    text = str(err).strip() or type(err).__name__
    line = text.splitlines()[0]
    return re.sub(r"^\[[0-9:]+\] \S+:[0-9]+: ", "", line)[:300]


class GrammarState:
    """Where one output stands in its constraint's grammar: what may follow, what must."""

    def __init__(self, matcher: Any, grammars: Grammars):
        self._matcher = matcher
        self._grammars = grammars

    @property
    def terminated(self) -> bool:
        """The grammar accepted a stop token: nothing may follow."""
        return self._matcher.is_terminated()

    def accept(self, token: int) -> bool:
        """Advance by one token; False (and no change) when the grammar does not allow it."""
        return not self.terminated and self._matcher.accept_token(int(token))

    def advance(self, tokens: Sequence[int]) -> int:
        """Advance along ``tokens`` up to the first one not allowed; returns how many it took."""
        for i, tok in enumerate(tokens):
            if not self.accept(tok):
                return i
        return len(tokens)

    def rollback(self, n: int) -> None:
        if n:
            self._matcher.rollback(n)

    def fork(self) -> "GrammarState":
        """An independent copy at the same point (a branch of a speculation tree)."""
        return GrammarState(self._matcher.fork(), self._grammars)

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Row ``row`` of an int32 bitmask [n, ceil(V/32)]: the tokens allowed next. A terminated
        state allows everything: nothing it scores is ever emitted (its output ended), and an
        all-masked row would be no distribution at all."""
        if self.terminated:
            bitmask[row].fill_(ALL_ALLOWED)
        else:
            self._matcher.fill_next_token_bitmask(bitmask, row)

    def forced_tokens(self, limit: int) -> list[int]:
        """The tokenizer's own encoding of the text the grammar forces next (at most ``limit``
        tokens, each allowed in turn); empty where more than one continuation is possible."""
        if limit <= 0 or self.terminated:
            return []
        text = self._matcher.find_jump_forward_string()
        if not text:
            return []
        ids = self._grammars.tokenizer.encode(text, add_special_tokens=False)[:limit]
        taken = self.advance(ids)
        self.rollback(taken)
        return ids[:taken]


def new_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    """An int32 bitmask [rows, ceil(V/32)] allowing every token."""
    return torch.full((rows, (vocab_size + 31) // 32), ALL_ALLOWED, dtype=torch.int32)


def chain_bitmask(state: GrammarState, tokens: Sequence[int], rows: int, vocab_size: int) -> torch.Tensor:
    """The masks of a verify chain, [rows, W]: row i allows what may follow ``tokens[:i]``.

    Each position's mask comes from the state after the tokens before it (never one mask for the
    whole chain). Rows after a token the grammar does not allow allow everything: that token's
    probability is 0 under the mask before it, so it is rejected and nothing after it is emitted.
    The state is left where it was."""
    bitmask = new_bitmask(rows, vocab_size)
    taken = 0
    for i in range(rows):
        state.fill(bitmask, i)
        if i >= len(tokens) or not state.accept(tokens[i]):
            break
        taken += 1
    state.rollback(taken)
    return bitmask


# Byte value -> its 8 bits as additive logit biases (0: allowed, -inf: forbidden), little-endian
# bit order as xgrammar packs them.
_BYTE_BIAS = torch.tensor([[0.0 if (byte >> bit) & 1 else -math.inf for bit in range(8)] for byte in range(256)])


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Logits [n, V] with the tokens a bitmask [n, W] forbids at -inf (a masked copy).

    Added as a bias looked up per bitmask byte: over a 152k vocabulary this costs ~60 us a row
    where a boolean masked_fill (or xgrammar's CPU kernel) costs 300-650 us."""
    n, vocab = logits.shape
    bias = torch.nn.functional.embedding(bitmask.view(torch.uint8).long(), _BYTE_BIAS).view(n, -1)[:, :vocab]
    return logits.float() + bias
