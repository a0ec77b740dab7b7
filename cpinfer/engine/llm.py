"""`LLM`: the offline API (shaped like vLLM's), a loop over `LLMEngine.step()`.

Finished sequences stay in the sharded KV cache (paper §3.3); a prompt that extends any cached prefix — an earlier
turn of the same chat, or a document other requests read too — reuses it as a partial prefill.
"""
from __future__ import annotations

import itertools
import time

from cpinfer.engine.llm_engine import LLMEngine
from cpinfer.engine.pd import make_engine
from cpinfer.engine.request import RequestOutput
from cpinfer.engine.sampling import SamplingParams

__all__ = ["LLM", "RequestOutput"]
_BAR_S = 0.1  # seconds between two updates of generate()'s progress bar


class LLM:
    """Serve a model of a supported family (docs/models.md) on `context_parallel_size` × `tensor_parallel_size`
    ranks.

    model: a Hugging Face folder (config.json + *.safetensors, tokenizer files to accept strings), a .gguf file,
    a Hugging Face Hub id (`org/name`: downloaded once into the Hub cache; `revision`, `download_dir`, `HF_TOKEN`,
    `HF_HUB_OFFLINE`), or None for the embedded default model. Keyword arguments: see `EngineConfig`
    (docs/engine.md).
    """

    def __init__(self, model: str | None = None, **kwargs):
        self.engine = make_engine(model, **kwargs)  # LLMEngine, or prefill / decode groups
        self._ids = itertools.count()

    @property
    def config(self):
        return self.engine.config

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def n(self) -> int:
        return self.engine.n

    # ------------------------------------------------------------------ lifecycle
    def shutdown(self) -> None:
        if getattr(self, "engine", None) is not None:
            self.engine.shutdown()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def __del__(self):
        try:
            self.shutdown()
        except Exception:  # noqa: BLE001
            pass

    # ------------------------------------------------------------------ generation
    def get_default_sampling_params(self) -> SamplingParams:
        """The sampling used when none is given: the model's generation_config.json defaults (generation_config
        "auto"), else SamplingParams()."""
        return SamplingParams(**self.engine.generation_defaults)

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """prompts: a string, a list of token ids, or a list of either. Returns one output per prompt, in order.
        A progress bar (tokens prefilled and generated) shows while it runs unless use_tqdm is False."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params or self.get_default_sampling_params()
        params = params if isinstance(params, list) else [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(params)} sampling params")
        eng = self.engine
        tokens = [eng.validate(p, sp) for p, sp in zip(prompts, params)]  # every prompt checked before compute
        ids = [f"offline-{next(self._ids)}" for _ in prompts]
        for rid, t, sp in zip(ids, tokens, params):
            eng.add_request(rid, t, sp)
        final: dict[str, RequestOutput] = {}
        bar = _progress(use_tqdm, sum(len(t) + sp.max_tokens for t, sp in zip(tokens, params)))
        shown = 0.0  # when the bar was last brought up to date (at most every _BAR_S: no cost per step)
        try:
            while len(final) < len(ids):
                for out in eng.step():
                    if out.finished:
                        final[out.request_id] = out
                if bar is not None and (time.monotonic() - shown >= _BAR_S or len(final) == len(ids)):
                    bar.update(_progress_done(eng, ids, tokens, params, final) - bar.n)
                    shown = time.monotonic()
        except BaseException:
            for rid in ids:  # leave the engine clean for the next call
                if rid in eng.requests:
                    eng.abort(rid)
            if eng.dead_error is None:
                eng.step()
            raise
        finally:
            if bar is not None:
                bar.close()
        return [final[rid] for rid in ids]

    def chat(self, messages, sampling_params: SamplingParams | None = None, use_tqdm: bool = True,
             chat_template_kwargs: dict | None = None) -> list[RequestOutput]:
        """One conversation (a list of {"role", "content"} dicts) or a list of them, through the tokenizer's chat
        template with the generation prompt added (`chat_template_kwargs`: more template variables, e.g.
        {"enable_thinking": False}). Returns one output per conversation."""
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [self.encode_chat(c, chat_template_kwargs) for c in convs]
        return self.generate(prompts, sampling_params, use_tqdm)

    def encode_chat(self, messages, chat_template_kwargs: dict | None = None) -> list[int]:
        return encode_chat(self.engine.tokenizer, messages, chat_template_kwargs)

    def cache_stats(self) -> dict:
        """KV tokens per rank, capacity per rank, and prefix-cache queries / hits (tokens)."""
        return self.engine.cache_stats()


def encode_chat(tokenizer, messages, chat_template_kwargs: dict | None = None) -> list[int]:
    """Token ids of a conversation under the tokenizer's chat template (generation prompt added)."""
    if tokenizer is None:
        raise ValueError("chat needs a tokenizer; the model directory has none")
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError("the tokenizer has no chat template; use generate() with a plain prompt")
    if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m and "content" in m
                                                 for m in messages):
        raise ValueError("messages must be a list of {'role': ..., 'content': ...} dicts")
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                        **(chat_template_kwargs or {}))
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # newer transformers return a BatchEncoding
        ids = ids["input_ids"]
    return [int(t) for t in ids]


def _progress_done(eng, ids, tokens, params, final) -> int:
    """Prompt tokens prefilled plus tokens generated so far (a finished request counts in full)."""
    done = 0
    for rid, t, sp in zip(ids, tokens, params):
        req = eng.requests.get(rid)
        if rid in final or req is None:
            done += len(t) + sp.max_tokens
        else:
            done += min(req.num_stored, len(t)) + len(req.out)
    return done


def _progress(enabled: bool, total: int):
    if not enabled:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, unit="tok", desc="prefill+decode", dynamic_ncols=True)
