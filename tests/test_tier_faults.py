"""Fault injection into the KV tiers on the real engine, live and across restarts, at CP 1 and 2: damaged K/V bytes,
a damaged header, truncated, deleted and junk files, a shared prefix's entry lost. A failed restore is a cache miss:
the engine never stalls or dies, every answer equals transformers', the bad entry leaves the index and the
directory, and only the lost prefix is recomputed. One pool of ranks serves the module.
"""
import json
import logging

import numpy as np
import pytest

from cpinfer import SamplingParams
from cpinfer.engine.kv.disk_files import read_header
from hf_oracle import check_against_hf, prompts_for
from pooled_engine import shard_engines
from wait_utils import wait_until

pytest.importorskip("transformers")

GREEDY = dict(temperature=0.0, logprobs=True, ignore_eos=True)
OUT = 5


@pytest.fixture(scope="module")
def ckpt(llama_checkpoint):
    return llama_checkpoint("gqa", max_position_embeddings=2048)


@pytest.fixture(scope="module")
def engines():
    """`engines(path, cp, **kw)`: an engine on a pool of cp ranks shared by the module (CP1 in the driver)."""
    yield from shard_engines()


def _turn(llm, prompts, path, steps=OUT):
    outs = llm.generate(prompts, SamplingParams(max_tokens=steps, **GREEDY))
    check_against_hf(path, outs, prompts, steps, check_prompt_lp=False)
    return outs


def _entry_files(d, tokens, pos0=0, must=True):
    """The files of the entry holding `tokens` from position pos0 (its token path starts with them)."""
    out = []
    for f in sorted(d.glob("*.safetensors")):
        h = read_header(f)
        if h.pos0 == pos0 and np.array_equal(h.path[:len(tokens)], tokens):
            out.append(f)
    assert out or not must, "no entry holds those tokens"
    return out


def damage(f, how):
    raw = bytearray(f.read_bytes())
    if how == "kv":  # flip 64 bytes in the middle of the tensor data: the header still verifies
        mid = len(raw) - 2048 if len(raw) > 8192 else len(raw) - 80
        raw[mid:mid + 64] = bytes(b ^ 0xA5 for b in raw[mid:mid + 64])
        f.write_bytes(bytes(raw))
    elif how == "header":
        n = int.from_bytes(raw[:8], "little")
        i = raw.index(b'"pos0"', 8, 8 + n)
        raw[i + 8] = ord("7") if raw[i + 8] != ord("7") else ord("3")  # a digit of the metadata: its CRC fails
        f.write_bytes(bytes(raw))
    elif how == "truncate":
        f.write_bytes(bytes(raw[:len(raw) // 2]))
    elif how == "delete":
        f.unlink()
    else:
        raise ValueError(how)


@pytest.mark.parametrize("cp", [1, 2])
@pytest.mark.parametrize("how", ["kv", "truncate", "delete"])
def test_restart_with_a_damaged_entry_answers_exactly_and_removes_it(ckpt, engines, tmp_path, caplog, cp, how):
    """The reported crash loop: a chat's entry damaged between two runs, the same chat sent alone after the
    restart. It is recomputed (no stall, no engine death), the bad files are gone, and a third run meets nothing
    bad."""
    d = tmp_path / "kv"
    doc = [3] + prompts_for(256, [180], seed=cp)[0]
    kw = dict(max_kv_tokens_per_rank=1024, kv_disk_dir=d)
    with engines(ckpt, cp, **kw) as llm:
        first = _turn(llm, [doc], ckpt)[0]
    bad = _entry_files(d, doc)
    for f in bad[:1]:
        damage(f, how)
    turn2 = doc + first.token_ids + [7, 8]
    caplog.set_level(logging.INFO, logger="cpinfer")
    with engines(ckpt, cp, **kw) as llm:
        out = _turn(llm, [turn2], ckpt)[0]
        assert out.num_cached_tokens == 0  # its only entry was bad: all recomputed
        assert llm.engine.dead_error is None
        llm.engine.kv.check_invariants()
        turn3 = turn2 + out.token_ids + [9]
        again = _turn(llm, [turn3], ckpt)[0]  # the engine goes on, from the device cache
        assert again.num_cached_tokens == len(turn2) + OUT - 1
    assert not any(f.exists() for f in bad), "the damaged entry is still on disk"
    caplog.clear()
    with engines(ckpt, cp, **kw) as llm:  # the next start meets nothing bad and restores the newest history
        out = _turn(llm, [turn3 + again.token_ids + [10]], ckpt)[0]
        assert out.num_cached_tokens == len(turn3) + OUT - 1
    assert "failed" not in caplog.text and "corrupt" not in caplog.text


@pytest.mark.parametrize("cp", [1, 2])
def test_live_damage_of_an_evicted_chat_is_a_cache_miss(ckpt, engines, tmp_path, caplog, cp):
    """Chat A moves to disk while others are served; its file is damaged; A's next turn alone is answered exactly
    (recomputed), the entry is dropped, other chats still restore."""
    d = tmp_path / "kv"
    docs = [[3 + i] + p for i, p in enumerate(prompts_for(256, [150, 140, 150, 130], seed=20 + cp))]
    with engines(ckpt, cp, max_kv_tokens_per_rank={1: 320, 2: 192}[cp], kv_disk_dir=d,
                 max_num_batched_tokens=96) as llm:
        first = [_turn(llm, [doc], ckpt)[0] for doc in docs]  # each evicts the one before: A (0) is on disk
        # the rank's writer thread writes it in the background (its rows read from memory until then): wait for
        # the file, however busy the machine, so that the damage is what A's next turn reads
        bad = wait_until(lambda: _entry_files(d, docs[0], must=False), what="chat A's entry written")
        damage(bad[0], "kv")
        caplog.set_level(logging.WARNING, logger="cpinfer")
        turn2 = [doc + o.token_ids + [5] for doc, o in zip(docs, first)]
        out = _turn(llm, [turn2[0]], ckpt)[0]
        assert out.num_cached_tokens == 0 and "is recomputed" in caplog.text
        assert llm.engine.dead_error is None
        out = _turn(llm, [turn2[1]], ckpt)[0]  # another chat's entry is intact: restored
        assert out.num_cached_tokens == len(docs[1]) + OUT - 1
        llm.engine.sync_tiers(force=True)
        llm.engine.kv.check_invariants()
        assert not any(f.exists() for f in bad)


def test_a_damaged_shared_prefix_costs_only_that_prefix(ckpt, engines, tmp_path, caplog):
    """Two chats share a 24-token prefix (a chat template); the entry holding it is damaged in its header (found
    at start) — the chat below it is adopted under a hole: its next turn recomputes the 24 tokens only and restores
    the rest of its history from disk, exactly."""
    d = tmp_path / "kv"
    rng = np.random.default_rng(5)
    template = [3] + rng.integers(3, 256, 23).tolist()
    a = template + rng.integers(3, 256, 120).tolist()
    b = template + rng.integers(3, 256, 130).tolist()
    kw = dict(max_kv_tokens_per_rank=1024, kv_disk_dir=d)
    with engines(ckpt, 2, **kw) as llm:
        out_a = _turn(llm, [a], ckpt)[0]
        out_b = _turn(llm, [b], ckpt)[0]
        assert out_b.num_cached_tokens == len(template)
    for f in _entry_files(d, a):  # a's entry holds the template (split off when b arrived) and a's own tokens
        damage(f, "header")
    turn2 = b + out_b.token_ids + [4, 5]
    caplog.set_level(logging.INFO, logger="cpinfer")
    with engines(ckpt, 2, **kw) as llm:
        assert "corrupt" in caplog.text
        out = _turn(llm, [turn2], ckpt)[0]
        assert out.num_cached_tokens == len(b) + OUT - 1 - len(template)  # all but the lost template
        assert llm.cache_stats()["tiers"]["disk"]["hit_tokens"] == out.num_cached_tokens
        llm.engine.kv.check_invariants()
        # a's chat lost its entry: recomputed, exactly, after the template that b's turn put back
        out = _turn(llm, [a + out_a.token_ids + [6]], ckpt)[0]
        assert out.num_cached_tokens == len(template)
    assert not any(".s" in p.name and p.stat().st_size == 0 for p in d.iterdir())


def test_a_clean_stop_leaves_every_entry_adoptable(ckpt, engines, tmp_path):
    """A prefix whose entry the disk tier let go of while it stayed on the device: the clean stop writes it, so a
    restart adopts the entry below it and the conversation comes back with its whole history."""
    d = tmp_path / "kv"
    rng = np.random.default_rng(6)
    doc = [3] + rng.integers(3, 256, 150).tolist()
    kw = dict(max_kv_tokens_per_rank=1024, kv_disk_dir=d)
    with engines(ckpt, 2, **kw) as llm:
        first = _turn(llm, [doc], ckpt)[0]
        turn2 = doc + first.token_ids[:2] + [4, 5]  # shares doc + 2 tokens: splits turn 1's segment
        second = _turn(llm, [turn2], ckpt)[0]
        kv = llm.engine.kv
        leaf = next(nd for nd in kv.nodes.values() if nd.pos0 == len(doc) + 2)  # turn 2's own segment
        head = leaf.parent
        assert head.on_device and head.disk is not None and leaf.disk is not None
        kv.tiers.drop_entry(head.disk.entry)  # LRU let the prefix's entry go; the prefix is still on the device
        assert head.disk is None and head.on_device
    turn3 = turn2 + second.token_ids + [6]
    with engines(ckpt, 1, **kw) as llm:
        out = _turn(llm, [turn3], ckpt)[0]
        assert out.num_cached_tokens == len(turn2) + OUT - 1


def test_a_failing_host_restore_is_a_cache_miss(ckpt, engines, tmp_path, monkeypatch, caplog):
    """CP1 (the rank runs in this process): a host-pool restore raises; the request is recomputed exactly, the bad
    host copy is dropped (the index and the pool agree), and the engine goes on."""
    from cpinfer.engine.kv.tier_store import RankTiers

    docs = [[3 + i] + p for i, p in enumerate(prompts_for(256, [150, 150], seed=31))]
    c = json.loads((ckpt / "config.json").read_text())
    token_bytes = 2 * c["num_hidden_layers"] * c["num_key_value_heads"] * (
        c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]) * 4
    with engines(ckpt, 1, max_kv_tokens_per_rank=320, kv_host_gib=192 * token_bytes / (1 << 30)) as llm:
        first = [_turn(llm, [d], ckpt)[0] for d in docs]  # doc 0 goes to the host pool
        real = RankTiers._from_host
        monkeypatch.setattr(RankTiers, "_from_host", lambda self, op: (_ for _ in ()).throw(MemoryError("pool")))
        caplog.set_level(logging.WARNING, logger="cpinfer")
        out = _turn(llm, [docs[0] + first[0].token_ids + [5]], ckpt)[0]
        assert out.num_cached_tokens == 0 and "KV host tier: restoring a cached prefix failed" in caplog.text
        monkeypatch.setattr(RankTiers, "_from_host", real)
        llm.engine.kv.check_invariants()
        assert llm.engine.dead_error is None
        _turn(llm, [docs[1] + first[1].token_ids + [6]], ckpt)
