"""`SpeculativeConfig`: the speculative-decoding settings, parsed from vLLM's keys and checked before any rank starts.

Two forms: prompt lookup (`{"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": a,
"prompt_lookup_max": b}`: drafts copied from earlier text of the same request, no extra model) and a draft model
(`{"model": PATH, "num_speculative_tokens": k}`: method "draft_model" implied).
"""
from __future__ import annotations

import dataclasses
import json

METHODS = ("ngram", "draft_model")
KEYS = ("method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "model")
MAX_SPECULATIVE_TOKENS = 32  # verification is one partial prefill of k+1 rows per request: keep it small
DEFAULT_LOOKUP_MAX = 5  # vLLM's defaults when neither bound is given
DEFAULT_LOOKUP_MIN = 1


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    """Validated speculative-decoding settings. `num_speculative_tokens` is the most tokens drafted per step; the
    engine adapts each request's own k below it (docs/engine.md, "Speculative decoding")."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = DEFAULT_LOOKUP_MIN  # ngram: the shortest suffix looked up
    prompt_lookup_max: int = DEFAULT_LOOKUP_MAX  # ngram: the longest suffix looked up (tried first)
    model: str | None = None  # draft_model: the draft checkpoint (a folder, Hub id or .gguf)

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"speculative_config: method must be one of {', '.join(repr(m) for m in METHODS)}, "
                             f"got {self.method!r}")
        _positive("num_speculative_tokens", self.num_speculative_tokens, MAX_SPECULATIVE_TOKENS)
        if self.method == "ngram":
            _positive("prompt_lookup_min", self.prompt_lookup_min)
            _positive("prompt_lookup_max", self.prompt_lookup_max)
            if self.prompt_lookup_min > self.prompt_lookup_max:
                raise ValueError(f"speculative_config: prompt_lookup_min ({self.prompt_lookup_min}) must be <= "
                                 f"prompt_lookup_max ({self.prompt_lookup_max})")
            if self.model is not None:
                raise ValueError("speculative_config: method 'ngram' takes no 'model' (prompt lookup needs no "
                                 "draft model); give {'model': PATH, 'num_speculative_tokens': k} for a draft model")
        elif not isinstance(self.model, str) or not self.model:
            raise ValueError("speculative_config: method 'draft_model' needs 'model': the draft checkpoint's path, "
                             f"Hub id or .gguf file, got {self.model!r}")

    @classmethod
    def parse(cls, value) -> "SpeculativeConfig | None":
        """None, a SpeculativeConfig, a dict of vLLM's keys or its JSON text → a validated config (None: off).
        Unknown keys are refused by name, listing the allowed ones."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"speculative_config is not valid JSON: {exc}") from None
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a dict (or its JSON text) with keys {', '.join(KEYS)}; "
                             f"got {type(value).__name__}")
        unknown = sorted(set(value) - set(KEYS))
        if unknown:
            raise ValueError(f"speculative_config: unknown key(s) {', '.join(repr(k) for k in unknown)}; "
                             f"allowed: {', '.join(KEYS)}")
        d = dict(value)
        if "method" not in d:
            if d.get("model") is None:
                raise ValueError("speculative_config needs 'method' (e.g. 'ngram') or 'model' (a draft checkpoint)")
            d["method"] = "draft_model"
        if "num_speculative_tokens" not in d:
            raise ValueError("speculative_config needs 'num_speculative_tokens' (the most tokens drafted per step)")
        lo, hi = d.get("prompt_lookup_min"), d.get("prompt_lookup_max")
        if d["method"] != "ngram" and (lo is not None or hi is not None):
            raise ValueError("speculative_config: prompt_lookup_min / prompt_lookup_max are for method 'ngram' only")
        if d["method"] == "ngram":  # one bound given: the other defaults to it (when that keeps min <= max)
            if hi is None:
                d["prompt_lookup_max"] = max(DEFAULT_LOOKUP_MAX, lo) if lo is not None else DEFAULT_LOOKUP_MAX
            if lo is None:
                d["prompt_lookup_min"] = min(DEFAULT_LOOKUP_MIN, d["prompt_lookup_max"]) if isinstance(
                    d["prompt_lookup_max"], int) else DEFAULT_LOOKUP_MIN
        return cls(**d)

    def as_dict(self) -> dict:
        """The vLLM-keyed form (logs, the server's /v1/models details)."""
        d = {"method": self.method, "num_speculative_tokens": self.num_speculative_tokens}
        if self.method == "ngram":
            d.update(prompt_lookup_min=self.prompt_lookup_min, prompt_lookup_max=self.prompt_lookup_max)
        else:
            d["model"] = self.model
        return d


def _positive(name: str, value, most: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1 or (most is not None and value > most):
        bound = f" and at most {most}" if most is not None else ""
        raise ValueError(f"speculative_config: {name} must be an integer >= 1{bound}, got {value!r}")
