"""Structured output: JSON-schema / JSON-object grammars through llguidance, one matcher per request on the driver.

The driver keeps each constrained request's matcher and ships the next token's allowed-token bitmask inside that
request's `SampleSpec`; the rank that holds the logits (a different one at every decode step, §3.6 round-robin)
applies it right before sampling. Grammars are compiled once per distinct grammar (an LRU cache) and validated
when the request is added, so a bad schema is a 400 before any compute.
"""
from __future__ import annotations

import collections
import json
import threading

import numpy as np

_CACHE_SIZE = 256


def _llguidance():
    try:
        import llguidance
    except ImportError:  # declared in pyproject; an install without it refuses constrained requests
        raise ValueError("structured output needs the 'llguidance' package (pip install llguidance)") from None
    return llguidance


def json_schema_grammar(schema: dict) -> str:
    """An llguidance grammar (JSON text) for values of `schema`, whitespace kept to single spaces at most."""
    llg = _llguidance()
    try:
        return llg.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults={"whitespace_flexible": False})
    except (ValueError, TypeError) as exc:
        raise ValueError(f"invalid JSON schema: {exc}") from None


class GrammarCompiler:
    """Validates grammars against the model's tokenizer (cached) and starts matchers. Thread-safe."""

    def __init__(self, tokenizer, vocab_size: int, eos_ids: tuple[int, ...]):
        self._hf, self.vocab_size, self.eos_ids = tokenizer, vocab_size, tuple(eos_ids)
        self._tok = None
        self._lock = threading.Lock()
        self._valid: collections.OrderedDict[str, None] = collections.OrderedDict()

    @property
    def tokenizer(self):
        """llguidance's view of the tokenizer, built on first use (about a second; once per engine)."""
        with self._lock:
            if self._tok is None:
                if self._hf is None:
                    raise ValueError("structured output needs a tokenizer; the model directory has none")
                _llguidance()
                import llguidance.hf

                try:
                    self._tok = llguidance.hf.from_tokenizer(self._hf, n_vocab=self.vocab_size, eos_token=list(self.eos_ids))
                except ValueError as exc:  # e.g. a slow (Python) tokenizer
                    raise ValueError(f"structured output is not available for this tokenizer: {exc}") from None
            return self._tok

    def validate(self, grammar: str) -> None:
        """ValueError with llguidance's message when the grammar cannot be used (cached by grammar text)."""
        with self._lock:
            if grammar in self._valid:
                self._valid.move_to_end(grammar)
                return
        error = _llguidance().LLMatcher.validate_grammar(grammar, self.tokenizer)
        if error:
            raise ValueError(f"the output constraint cannot be compiled: {error.splitlines()[0][:500]}")
        with self._lock:
            self._valid[grammar] = None
            while len(self._valid) > _CACHE_SIZE:
                self._valid.popitem(last=False)

    def matcher(self, grammar: str) -> "Matcher":
        self.validate(grammar)
        return Matcher(_llguidance().LLMatcher(self.tokenizer, grammar, log_level=0), self.vocab_size)


class Matcher:
    """One request's grammar state: the allowed next tokens, advanced by each sampled token."""

    def __init__(self, matcher, vocab_size: int):
        self._m = matcher
        self.words = (vocab_size + 31) // 32
        self._check()

    def _check(self) -> None:
        if self._m.is_error():
            raise ValueError(f"output constraint error: {self._m.get_error().splitlines()[0][:300]}")

    def bitmask(self) -> np.ndarray:
        """[ceil(V/32)] int32: bit j of word i set = token 32 i + j is allowed next."""
        raw = np.frombuffer(self._m.compute_bitmask(), dtype="<i4")
        self._check()
        out = np.zeros(self.words, dtype=np.int32)
        n = min(len(raw), self.words)
        out[:n] = raw[:n]
        return out

    def consume(self, token: int) -> None:
        self._m.consume_token(int(token))
        self._check()

    def rollback(self, num_tokens: int) -> None:
        """Undo the last num_tokens consumed (speculative decoding walks a draft, then steps back)."""
        if num_tokens:
            self._m.rollback(int(num_tokens))
            self._check()

    @property
    def done(self) -> bool:
        """The grammar is complete and allows nothing more (the output must end here)."""
        return self._m.is_stopped()
