"""Hybrid (linear-attention) models through preemption and over the KV tiers against transformers: a turn 2 that
starts from a state snapshot and is preempted mid-generation recomputes and stays exact; a conversation evicted from the device
comes back from the host tier and from the disk tier with the recurrent-state snapshot it continues from (turn 2
prefills only its new tokens); entries written at CP1 are reloaded at CP2 (states are replicas: any CP size reads
them); a state that cannot be restored (damaged, or of the wrong shape) is a cache miss, recomputed, never a fault.
One pool of ranks per CP size serves the module."""
import logging

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from cpinfer import SamplingParams
from cpinfer.engine.kv.disk_files import EntryHeader, read_header, write_entry
from hf_oracle import check_against_hf, prompts_for
from pooled_engine import shard_engines

pytest.importorskip("transformers")

GREEDY = dict(temperature=0.0, logprobs=True, ignore_eos=True)
OUT = 6  # tokens per turn
STATE_TOKENS = 408  # the state cache of max_num_seqs=2 (2 x 2 + 64 slots) in KV tokens' worth per rank
TOKEN_BYTES = 2 * 2 * 2 * 16 * 4  # the tiny qwen3_5's K/V per token: 2 attention layers x (K, V) x 2 heads x 16


@pytest.fixture(scope="module")
def ckpt(llama_checkpoint):
    return llama_checkpoint("qwen3_5", max_position_embeddings=2048)


@pytest.fixture(scope="module")
def engines():
    yield from shard_engines()


def _engine(engines, ckpt, cp, device_tokens, **kw):
    """max_num_seqs 2: the state cache takes STATE_TOKENS out of max_kv_tokens_per_rank; the rest is K/V."""
    return engines(ckpt, cp, max_kv_tokens_per_rank=STATE_TOKENS + device_tokens, max_num_seqs=2,
                   max_num_batched_tokens=96, **kw)


def _turn(llm, prompts, path):
    outs = llm.generate(prompts, SamplingParams(max_tokens=OUT, **GREEDY))
    check_against_hf(path, outs, prompts, OUT, check_prompt_lp=False)
    return outs


def _docs(n, seed):
    return [[3 + i] + p for i, p in enumerate(prompts_for(256, [150, 140, 150, 130][:n], seed=seed))]


@pytest.mark.parametrize("cp", [1, 2])
def test_a_preempted_second_turn_recomputes_exactly(ckpt, engines, cp):
    """Two turn-2 requests continuing from their turn-1 snapshots overflow the device together: the newest is
    preempted mid-generation (its live state freed, its blocks too), re-attaches (to its snapshot, or to nothing
    once that was evicted) and finishes with transformers' tokens."""
    with _engine(engines, ckpt, cp, {1: 384, 2: 192}[cp]) as llm:
        eng = llm.engine
        docs = _docs(2, seed=30 + cp)
        first = [_turn(llm, [d], ckpt)[0] for d in docs]
        turn2 = [d + o.token_ids + [5, 6, 7] for d, o in zip(docs, first)]
        before = eng.stats().preemptions
        outs = llm.generate(turn2, SamplingParams(max_tokens=80, **GREEDY))
        assert eng.stats().preemptions > before
        check_against_hf(ckpt, outs, turn2, 80, check_prompt_lp=False)
        eng.kv.check_invariants()
        assert eng.kv.states.in_use == eng.kv.state_snapshots  # every live slot went back


@pytest.mark.parametrize("tier, cp", [("host", 1), ("host", 2), ("disk", 1), ("disk", 2)])
def test_turn_two_from_a_lower_tier_matches_hf(ckpt, engines, tmp_path, tier, cp):
    """Four chats on a device holding about two: turn 2 of each, oldest last, continues from its end-of-turn state
    snapshot restored with its K/V from the host tier (host only) or the disk tier (disk only): all of turn 1
    counted as cached, the answer transformers' on the whole conversation."""
    dev = {1: 320, 2: 192}[cp]
    lower = dict(kv_host_gib=2048 * TOKEN_BYTES / (1 << 30)) if tier == "host" else dict(kv_disk_dir=tmp_path / "kv")
    with _engine(engines, ckpt, cp, dev, **lower) as llm:
        docs = _docs(4, seed=20 + cp)
        first = [_turn(llm, [d], ckpt)[0] for d in docs]  # one at a time: each pushes older ones off the device
        assert all(o.num_cached_tokens == 0 for o in first)
        turn2 = [d + o.token_ids + [5, 6, 7] for d, o in zip(docs, first)]
        for i in (3, 2, 1, 0):
            out = _turn(llm, [turn2[i]], ckpt)[0]
            assert out.num_cached_tokens == len(docs[i]) + OUT - 1  # turn 1 less its last token: none recomputed
        t = llm.cache_stats()["tiers"]
        assert t[tier]["hit_tokens"] > 0 and t[tier]["restored_tokens"] > 0, t
        assert sum(t[x]["hit_tokens"] for x in ("device", "host", "disk")) == llm.cache_stats()["prefix_cache_hits"]
        llm.engine.kv.check_invariants()


def _state_file(directory, doc):
    """The entry file of doc's first segment that carries its recurrent-state snapshot."""
    for f in sorted(directory.glob("*.safetensors")):
        h = read_header(f)
        if h.pos0 == 0 and h.states and np.array_equal(h.path[:len(doc)], doc):
            return f, h
    raise AssertionError("no entry file carries the snapshot")


def test_reload_at_another_cp_size_and_bad_states(ckpt, engines, tmp_path, caplog):
    """Entries (K/V and state snapshots) written at CP1 are reloaded at CP2 and continue exactly. Then one entry's
    state is rewritten with the wrong shape (checksums intact) and another's bytes damaged: both prefixes are
    recomputed (a cache miss each), the answers still transformers'."""
    d = tmp_path / "kv"
    docs = _docs(3, seed=7)
    with _engine(engines, ckpt, 1, 2048, kv_disk_dir=d) as llm:
        first = _turn(llm, docs, ckpt)
    turn2 = [p + o.token_ids + [4, 5] for p, o in zip(docs, first)]
    caplog.set_level(logging.INFO, logger="cpinfer")
    with _engine(engines, ckpt, 2, 2048, kv_disk_dir=d) as llm:
        assert "another CP size" in caplog.text
        out = _turn(llm, turn2[:1], ckpt)[0]
        assert out.num_cached_tokens == len(docs[0]) + OUT - 1
        assert llm.cache_stats()["tiers"]["disk"]["hit_tokens"] == out.num_cached_tokens
    # doc 1: its snapshot rewritten with a state of the wrong shape (a valid file: only the state restore fails)
    f, h = _state_file(d, docs[1])
    tensors = load_file(str(f))
    kv = tensors["kv"]
    states = {k: (torch.zeros(3, 5) if k.startswith("state.") else v) for k, v in tensors.items()
              if k.startswith(("state.", "tail."))}
    write_entry(d, EntryHeader(h.layout, h.entry, h.shard, h.cp, h.tp_rank, h.pos0, h.count, h.path, h.positions, 0,
                               h.states), kv, states=states)
    # doc 2: damaged bytes (the K/V and the state of the file both fail their checksum)
    f2, _ = _state_file(d, docs[2])
    raw = bytearray(f2.read_bytes())
    raw[-5] ^= 0xFF
    f2.write_bytes(bytes(raw))
    caplog.clear()
    with _engine(engines, ckpt, 2, 2048, kv_disk_dir=d) as llm:
        outs = _turn(llm, turn2[1:], ckpt)
        assert [o.num_cached_tokens for o in outs] == [0, 0]
        assert "restoring a recurrent-state snapshot failed" in caplog.text
        follow = turn2[1] + outs[0].token_ids + [9]  # recomputed above: its new snapshot is on the device now
        assert _turn(llm, [follow], ckpt)[0].num_cached_tokens == len(turn2[1]) + OUT - 1
        llm.engine.kv.check_invariants()
