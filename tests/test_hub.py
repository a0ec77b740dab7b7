"""Models by Hugging Face Hub id, without network: a Hub cache folder in huggingface_hub's own layout
(tests/hub_cache.py) with HF_HUB_OFFLINE=1. `resolve_model`, `cpinfer generate MODEL` and `LLM(MODEL)` find the
snapshot by id; a missing id is a clear error naming the id and the cache; generation_config.json's sampling
defaults apply when nothing is set.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from cpinfer.model.resolve import generation_defaults, resolve_model, resolve_tokenizer
from hub_cache import COMMIT, write_hub_cache
from server_utils import TINY_VOCAB, write_tiny_tokenizer

REPO = "tiny-org/tiny-llama"


@pytest.fixture(scope="module")
def hub(llama_checkpoint, tmp_path_factory):
    """(cache folder, source folder): the tiny GQA checkpoint with a tokenizer, cached as REPO."""
    src = tmp_path_factory.mktemp("hub_src")
    for f in llama_checkpoint("gqa", vocab_size=TINY_VOCAB).iterdir():
        shutil.copy(f, src / f.name)
    write_tiny_tokenizer(src)
    cache = tmp_path_factory.mktemp("hub_cache")
    write_hub_cache(cache, REPO, src)
    return cache, src


@pytest.fixture
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def test_a_hub_id_resolves_to_its_cached_snapshot_offline(hub, offline):
    cache, src = hub
    snapshot = cache / f"models--{REPO.replace('/', '--')}" / "snapshots" / COMMIT
    assert resolve_model(REPO, download_dir=cache) == snapshot
    assert resolve_model(REPO, download_dir=cache, revision=COMMIT) == snapshot  # a commit as the revision
    assert (snapshot / "model.safetensors").read_bytes() == (src / "model.safetensors").read_bytes()
    assert resolve_tokenizer(REPO, download_dir=cache) == snapshot


@pytest.mark.parametrize("repo, revision, fragment", [
    ("tiny-org/missing", None, "'tiny-org/missing' is not in the Hugging Face cache"),
    (REPO, "v2", "at revision 'v2' is not in the Hugging Face cache"),
])
def test_a_missing_id_offline_names_the_id_and_the_cache(hub, offline, repo, revision, fragment):
    cache, _ = hub
    with pytest.raises(ValueError) as err:
        resolve_model(repo, download_dir=cache, revision=revision)
    assert fragment in str(err.value) and str(cache) in str(err.value) and "HF_HUB_OFFLINE=1" in str(err.value)


def test_paths_that_are_not_hub_ids_say_what_is_accepted(tmp_path):
    with pytest.raises(ValueError, match="no such folder or .gguf file, nor a Hugging Face Hub id"):
        resolve_model(str(tmp_path / "no" / "such" / "folder"))


def _cli(*argv, env=None, timeout=300):
    return subprocess.run([sys.executable, "-m", "cpinfer", *argv], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", **(env or {})})


def test_generate_by_hub_id_offline_matches_the_folder(hub):
    from cpinfer import LLM, SamplingParams

    cache, src = hub
    r = _cli("generate", REPO, "--download-dir", str(cache), "--prompt", "hello hub", "--max-tokens", "4",
             "--ignore-eos", "--threads-per-rank", "1", "--json")
    assert r.returncode == 0, r.stderr[-3000:]
    by_id = json.loads(r.stdout.strip().splitlines()[-1])["token_ids"]
    with LLM(str(src), threads_per_rank=1) as llm:
        ref = llm.generate("hello hub", SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True),
                           use_tqdm=False)[0]
    assert by_id == ref.token_ids and len(by_id) == 4


def test_cli_missing_id_offline_exits_2_before_any_rank(hub):
    cache, _ = hub
    r = _cli("serve", "tiny-org/missing", "--download-dir", str(cache), timeout=60)
    assert r.returncode == 2
    assert "'tiny-org/missing' is not in the Hugging Face cache" in r.stderr and str(cache) in r.stderr
    assert "Traceback" not in r.stderr


def test_llm_takes_a_hub_id_and_the_generation_config_defaults(hub, offline, tmp_path, capsys):
    from cpinfer import LLM, SamplingParams

    cache, src = hub
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"do_sample": True, "temperature": 0.6, "top_p": 0.95, "top_k": 20, "eos_token_id": 2}))
    assert generation_defaults(tmp_path) == {"temperature": 0.6, "top_p": 0.95, "top_k": 20}
    assert generation_defaults(tmp_path, "vllm") == {}
    assert generation_defaults(src) == {}  # no generation_config.json: the library's defaults
    (tmp_path / "generation_config.json").write_text(json.dumps({"do_sample": False, "temperature": 0.6}))
    assert generation_defaults(tmp_path) == {"temperature": 0.0}  # greedy by the model's choice
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.7, "max_new_tokens": 40}))
    assert generation_defaults(tmp_path) == {"temperature": 0.7, "max_tokens": 40}  # vLLM's default max_tokens
    from types import SimpleNamespace

    from cpinfer.server.state import OpenAIServer

    server = SimpleNamespace(max_model_len=100, sampling_defaults=generation_defaults(tmp_path))
    assert [OpenAIServer.default_max_tokens(server, n) for n in (10, 70, 99, 120)] == [40, 30, 1, 1]
    server.sampling_defaults = {}  # no max_new_tokens: the rest of the context
    assert OpenAIServer.default_max_tokens(server, 10) == 90
    (tmp_path / "generation_config.json").write_text(json.dumps({"do_sample": False, "temperature": 0.6}))
    with pytest.raises(ValueError, match="expected 'auto', 'vllm' or a folder"):
        generation_defaults(src, str(tmp_path / "none"))
    with LLM(REPO, download_dir=str(cache), threads_per_rank=1, generation_config=str(tmp_path), seed=7) as llm:
        assert llm.engine.model_path.endswith(COMMIT)
        params = llm.get_default_sampling_params()
        assert params.temperature == 0.0
        capsys.readouterr()
        out = llm.generate("hi", SamplingParams(max_tokens=3, ignore_eos=True))[0]  # a progress bar by default
        assert len(out.token_ids) == 3 and "prefill+decode: 100%" in capsys.readouterr().err
        llm.generate("hi", SamplingParams(max_tokens=3), use_tqdm=False)
        assert "prefill+decode" not in capsys.readouterr().err
