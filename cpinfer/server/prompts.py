"""Prompts to token ids for the server, off the event loop: chat templating and tokenizing run in a small thread
pool (the Rust tokenizer's batch call releases the GIL), after a character-count check that rejects prompts which
cannot fit `max_model_len` before any of that work.

Special-token text inside message content ("<|im_end|>" typed by a user) is tokenized as plain text, so a user
cannot forge a system turn; `allow_special_tokens_in_content=True` restores the template's plain tokenization.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import copy
import functools
import json
import secrets
from typing import Any, Callable

_WORKERS = 2
_SLACK = 2  # normalizers may shrink text: allow twice the characters the longest token could cover


class PromptError(ValueError):
    """A prompt that cannot be served (too long, special-token text where it is not allowed, a template error)."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


class PromptEncoder:
    """Token ids of chat and completion prompts for one tokenizer; every method may block: call `run`."""

    def __init__(self, tokenizer, max_model_len: int, allow_special_tokens_in_content: bool = False,
                 chat_template: str | None = None):
        self.tok, self.max_model_len = tokenizer, max_model_len
        self.template = chat_template  # --chat-template; None: the tokenizer's own
        self.allow_special = allow_special_tokens_in_content
        self._pool = concurrent.futures.ThreadPoolExecutor(_WORKERS, thread_name_prefix="cpinfer-tokenize")
        self._raw = self._as_text = None
        self.specials: tuple[str, ...] = ()
        self.max_chars = max_model_len * 64 * _SLACK
        if tokenizer is not None:
            self._raw = getattr(tokenizer, "backend_tokenizer", None)  # Rust tokenizer of a fast HF tokenizer
            if self._raw is not None:
                self._as_text = copy.deepcopy(self._raw)
                self._as_text.encode_special_tokens = True  # special-token strings become ordinary text
            decoder = getattr(tokenizer, "added_tokens_decoder", {}) or {}
            self.specials = tuple(sorted({t.content for t in decoder.values() if getattr(t, "special", False)}
                                         | set(getattr(tokenizer, "all_special_tokens", []) or []), key=len))
            longest = max((len(t) for t in tokenizer.get_vocab()), default=64)
            self.max_chars = max_model_len * max(longest, 1) * _SLACK

    async def run(self, fn: Callable, *args) -> Any:
        """Run `fn(*args)` in the tokenizer pool (never on the event loop)."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------------ checks
    def check_chars(self, n: int, param: str) -> None:
        if n > self.max_chars:
            raise PromptError(f"the prompt has {n} characters; no prompt over {self.max_chars} characters fits "
                              f"max_model_len {self.max_model_len} tokens with this tokenizer", param)

    def _need_tokenizer(self, param: str) -> None:
        if self.tok is None:
            raise PromptError("the model has no tokenizer; send token ids", param)

    def _special_in(self, text: str) -> str | None:
        return next((s for s in self.specials if s in text), None)

    # ------------------------------------------------------------------ encoding
    def _encode(self, texts: list[str], as_text: bool) -> list[list[int]]:
        if self._raw is None:  # a slow (Python) tokenizer: no GIL release, still off the loop
            return [self.tok.encode(t, add_special_tokens=False, split_special_tokens=as_text) for t in texts]
        raw = self._as_text if as_text else self._raw
        return [e.ids for e in raw.encode_batch(texts, add_special_tokens=False)]

    def encode_text(self, text: str, add_special_tokens: bool = True, param: str = "prompt") -> list[int]:
        """A completion prompt (special-token strings in it are special tokens, as in vLLM's completions)."""
        self._need_tokenizer(param)
        self.check_chars(len(text), param)
        if self._raw is None:
            return list(self.tok.encode(text, add_special_tokens=add_special_tokens))
        return list(self._raw.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids)

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True, tools: list | None = None,
                    param: str = "messages", template_kwargs: dict | None = None) -> list[int]:
        """Messages through the chat template (`template_kwargs`: more variables for it, e.g. enable_thinking);
        content's special-token text stays text unless allowed."""
        self._need_tokenizer(param)
        render = functools.partial(self._render, template_kwargs=template_kwargs or {})
        if self.template is None and getattr(self.tok, "chat_template", None) is None:
            raise PromptError("the tokenizer has no chat template; use /v1/completions with a plain prompt", param)
        contents = [m.get("content") or "" for m in messages]
        others = json.dumps([{k: v for k, v in m.items() if k != "content"} for m in messages] + [tools or []])
        self.check_chars(sum(map(len, contents)) + len(others), param)
        if not self.allow_special:
            found = self._special_in(others)
            if found is not None:
                raise PromptError(f"special-token text {found!r} is not allowed in message names, tool calls or "
                                  "tools", param)
        protect = [i for i, c in enumerate(contents) if not self.allow_special and self._special_in(c) is not None]
        if not protect:
            text = render(messages, add_generation_prompt, tools, param)
            return self._encode([text], as_text=False)[0]
        return self._encode_protected(render, messages, contents, protect, add_generation_prompt, tools, param)

    def _render(self, messages, add_generation_prompt: bool, tools, param: str, template_kwargs: dict) -> str:
        try:
            return self.tok.apply_chat_template(messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                                tokenize=False, chat_template=self.template, **template_kwargs)
        except Exception as exc:  # noqa: BLE001 - a template that refuses these messages (e.g. role order)
            raise PromptError(f"the chat template rejected the messages: {str(exc)[:300]}", param) from None

    def _encode_protected(self, render, messages, contents, protect, add_generation_prompt, tools,
                          param) -> list[int]:
        """Render with placeholders in the protected contents, then tokenize template text and content apart."""
        nonce = secrets.token_hex(8)
        marks = {i: f"\x1ecpinfer{nonce}{i}\x1f" for i in protect}
        swapped = [dict(m, content=marks[i]) if i in marks else m for i, m in enumerate(messages)]
        text = render(swapped, add_generation_prompt, tools, param)
        pieces: list[tuple[str, bool]] = []
        for i in protect:
            before, found, text = text.partition(marks[i])
            if not found or marks[i] in text:
                raise PromptError("message content contains special-token text and this chat template does not "
                                  "place contents verbatim; remove it (or start the server with "
                                  "--allow-special-tokens-in-content)", param)
            pieces += [(before, False), (contents[i], True)]
        pieces.append((text, False))
        return [t for enc in self._encode_split(pieces) for t in enc]

    def _encode_split(self, pieces: list[tuple[str, bool]]) -> list[list[int]]:
        plain = self._encode([p for p, t in pieces if not t], as_text=False)
        text = self._encode([p for p, t in pieces if t], as_text=True)
        out, a, b = [], iter(plain), iter(text)
        for _, as_text in pieces:
            out.append(next(b) if as_text else next(a))
        return out
