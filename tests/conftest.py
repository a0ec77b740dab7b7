"""Shared pytest fixtures: tiny Llama checkpoints, built once per session and cached by their arguments.

    def test_x(llama_checkpoint):      path = llama_checkpoint("mqa", num_hidden_layers=1)   # HF save_pretrained
    def test_y(random_checkpoint):     path = random_checkpoint(seed=3, hidden_size=64)     # torch-only writer
Variants: "gqa" (4:1), "mqa", "mha", "tied", "llama3" (see tests/checkpoints.py).
"""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Callable

import pytest

from checkpoints import write_hf_checkpoint
from cpinfer.model.random_checkpoint import write_random_checkpoint


def pytest_sessionstart(session) -> None:
    """Build (or load) the CPU attention kernels once, before any test: the first engine start would otherwise
    compile them inside whichever test comes first (~10-20 s; `cpinfer/attention/cpu_kernels.py`)."""
    from cpinfer.attention.cpu_kernels import decode_attention_op

    decode_attention_op()


def _quiet_transformers() -> None:
    try:
        import transformers
    except ImportError:
        return
    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()


def _cached_factory(tmp_path_factory, writer: Callable[..., Path], prefix: str) -> Callable[..., Path]:
    cache: dict[str, Path] = {}

    def make(*args: Any, **kwargs: Any) -> Path:
        key = json.dumps([args, kwargs], sort_keys=True, default=str)
        if key not in cache:
            cache[key] = writer(tmp_path_factory.mktemp(prefix), *args, **kwargs)
        return cache[key]

    return make


@pytest.fixture(scope="session")
def llama_checkpoint(tmp_path_factory) -> Callable[..., Path]:
    """`make(variant="gqa", *, seed=0, max_shard_size=None, **config_overrides) -> dir` (needs transformers)."""
    pytest.importorskip("transformers")
    _quiet_transformers()
    return _cached_factory(tmp_path_factory, write_hf_checkpoint, "hf_llama")


@pytest.fixture(scope="session")
def random_checkpoint(tmp_path_factory) -> Callable[..., Path]:
    """`make(*, seed=0, dtype=torch.float32, **config_overrides) -> dir` (torch + safetensors only)."""
    return _cached_factory(tmp_path_factory, write_random_checkpoint, "rand_llama")


class _Warnings(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


@pytest.fixture
def cpinfer_warnings():
    """The messages of the warnings (and worse) the `cpinfer` logger emits during the test (it does not propagate
    to the root logger, so pytest's caplog does not see them)."""
    handler = _Warnings()
    logger = logging.getLogger("cpinfer")
    logger.addHandler(handler)
    yield handler.messages
    logger.removeHandler(handler)
