"""The KV tiers on the real engine against Hugging Face transformers at CP 1, 2 and 3: conversations evicted from a
device cache that holds about one of them come back from the host pool and from disk (segments split after a restore,
a prefix shared by requests restored together), after a restart at another CP size, past corrupt and foreign files
and a failing disk — every answer equal to transformers'. Also the entry files' keys and checks. One pool of ranks per
world size serves the module.
"""
import errno
import json
import logging
import os

import numpy as np
import pytest
import torch

from cpinfer import SamplingParams
from cpinfer.engine.kv import tier_store
from cpinfer.engine.kv.disk_files import (CorruptEntry, EntryHeader, Layout, file_name, read_header, read_rows, scan,
                                     write_entry)
from hf_oracle import check_against_hf, prompts_for
from pooled_engine import shard_engines

pytest.importorskip("transformers")

GREEDY = dict(temperature=0.0, logprobs=True, ignore_eos=True)
OUT = 6  # tokens per turn


@pytest.fixture(scope="module")
def ckpt(llama_checkpoint):
    return llama_checkpoint("gqa", max_position_embeddings=2048)


@pytest.fixture(scope="module")
def engines():
    """`engines(path, cp, **kw)`: an engine on a pool of cp ranks shared by the module (CP1 in the driver)."""
    yield from shard_engines()


def _token_bytes(path) -> int:
    c = json.loads((path / "config.json").read_text())
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    return 2 * c["num_hidden_layers"] * c["num_key_value_heads"] * head_dim * 4  # fp32 K and V, every layer


def _gib(path, tokens: int) -> float:
    return tokens * _token_bytes(path) / (1 << 30)


def _turn(llm, prompts, path):
    outs = llm.generate(prompts, SamplingParams(max_tokens=OUT, **GREEDY))
    check_against_hf(path, outs, prompts, OUT, check_prompt_lp=False)
    return outs


def _tiers(llm):
    return llm.cache_stats()["tiers"]


@pytest.mark.parametrize("cp", [1, 2, 3])
def test_restored_conversations_match_hf(ckpt, engines, tmp_path, cp):
    """Four 150-token chats on a device holding about two; the host holds about one more, the disk the rest. Turn 2
    of each reads its whole history back (host or disk) and answers as transformers; a prompt that leaves a restored
    history half-way splits its segment; two requests sharing a restored history are restored together."""
    dev = {1: 320, 2: 192, 3: 128}[cp]  # tokens per rank (64-token blocks): about two of the chats
    host = {1: 192, 2: 128, 3: 128}[cp]  # host-pool tokens per rank: one or two chats
    with engines(ckpt, cp, max_kv_tokens_per_rank=dev, kv_host_gib=_gib(ckpt, host), kv_disk_dir=tmp_path / "kv",
                 max_num_batched_tokens=96) as llm:
        vocab = llm.config.vocab_size
        docs = [[3 + i] + p for i, p in enumerate(prompts_for(vocab, [150, 140, 150, 130], seed=10 + cp))]
        first = [_turn(llm, [d], ckpt)[0] for d in docs]  # one at a time: each evicts the one before
        assert all(o.num_cached_tokens == 0 for o in first)
        turn2 = [d + o.token_ids + [5, 6, 7] for d, o in zip(docs, first)]
        for i in (2, 1, 0, 3):  # newest first: the device and the host hold the newest, the disk the oldest
            out = _turn(llm, [turn2[i]], ckpt)[0]
            assert out.num_cached_tokens == len(docs[i]) + OUT - 1  # the whole history, restored or on device
        t = _tiers(llm)
        assert t["host"]["hit_tokens"] > 0 and t["disk"]["hit_tokens"] > 0, t
        for tier in ("host", "disk"):
            assert t[tier]["restored_tokens"] > 0 and t[tier]["restored_bytes"] > 0 and t[tier]["restore_s"] > 0
        assert sum(t[x]["hit_tokens"] for x in ("device", "host", "disk")) == llm.cache_stats()["prefix_cache_hits"]
        # doc 2 went down a tier; a prompt sharing its first 100 tokens splits the restored segment
        split = docs[2][:100] + [9, 10, 11]
        out = _turn(llm, [split], ckpt)[0]
        assert out.num_cached_tokens == 100
        # doc 0's turn 2 is evicted again (device and host are small); two follow-ups restore it once, share it
        pair = [turn2[0] + o for o in ([12, 13], [14])]
        hits_before = dict((x, _tiers(llm)[x]["hit_tokens"]) for x in ("host", "disk"))
        _turn(llm, [docs[1] + [3] * 20], ckpt)  # pushes doc 0's history off the device
        outs = _turn(llm, pair, ckpt)
        assert [o.num_cached_tokens for o in outs] == [len(turn2[0])] * 2
        t = _tiers(llm)
        assert sum(t[x]["hit_tokens"] - hits_before[x] for x in ("host", "disk")) > 0
        llm.engine.kv.check_invariants()


def test_restart_at_another_cp_size_and_corrupt_entries(ckpt, engines, tmp_path, caplog):
    """Entries written at CP2 are read at CP3 and CP1 (tokens re-placed), after a restart; a file whose K/V were
    damaged is found at the restore, its history recomputed — the answer stays exact."""
    d = tmp_path / "kv"
    docs = [[3 + i] + p for i, p in enumerate(prompts_for(256, [200, 170, 160], seed=3))]  # distinct starts
    kw = dict(max_kv_tokens_per_rank=4096, kv_disk_dir=d)
    with engines(ckpt, 2, **kw) as llm:
        first = _turn(llm, docs, ckpt)
    assert sorted(p.suffix for p in d.iterdir() if not p.name.startswith(".")) == [".safetensors"] * 6
    turn2 = [p + o.token_ids + [4, 5] for p, o in zip(docs, first)]
    caplog.set_level(logging.INFO, logger="cpinfer")
    with engines(ckpt, 3, **kw) as llm:
        assert "another CP size" in caplog.text
        out = _turn(llm, turn2[:1], ckpt)[0]
        assert out.num_cached_tokens == len(docs[0]) + OUT - 1
        assert _tiers(llm)["disk"]["hit_tokens"] == out.num_cached_tokens
    # damage the K/V (not the header) of every file of doc 1's entry: adopted at start, refused at the restore
    for f in sorted(d.glob("*.safetensors")):
        h = read_header(f)
        if h.pos0 == 0 and np.array_equal(h.path[:len(docs[1])], docs[1]):
            raw = bytearray(f.read_bytes())
            raw[-5] ^= 0xFF
            f.write_bytes(bytes(raw))
    caplog.clear()
    with engines(ckpt, 1, **kw) as llm:
        outs = _turn(llm, turn2, ckpt)  # doc 1 recomputed, docs 0 and 2 restored
        assert outs[1].num_cached_tokens == 0
        assert outs[0].num_cached_tokens == len(turn2[0]) - 1 and outs[2].num_cached_tokens == len(docs[2]) + OUT - 1
        assert "restoring a cached prefix failed" in caplog.text
        llm.engine.kv.check_invariants()


def test_entries_of_another_model_are_never_loaded(ckpt, llama_checkpoint, engines, tmp_path, caplog):
    """A directory written by one checkpoint, opened with another (other weights, same shapes): nothing adopted,
    a warning, the answers the other model's."""
    d = tmp_path / "kv"
    prompt = prompts_for(256, [120], seed=4)
    with engines(ckpt, 1, max_kv_tokens_per_rank=2048, kv_disk_dir=d) as llm:
        _turn(llm, prompt, ckpt)
    other = llama_checkpoint("gqa", seed=1, max_position_embeddings=2048)
    caplog.set_level(logging.INFO, logger="cpinfer")
    with engines(other, 1, max_kv_tokens_per_rank=2048, kv_disk_dir=d) as llm:
        assert "of another model or layout" in caplog.text
        assert _tiers(llm)["disk"]["entries"] == 0
        out = _turn(llm, [prompt[0] + [7]], other)[0]
        assert out.num_cached_tokens == 0


def test_a_full_disk_is_logged_once_and_serving_goes_on(ckpt, engines, tmp_path, monkeypatch, caplog):
    """Every write fails with ENOSPC (CP1: the rank runs in this process): one warning, writes pause (retried with
    backoff), the answers stay exact and evicted K/V are recomputed."""
    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(tier_store, "write_entry", full)
    caplog.set_level(logging.INFO, logger="cpinfer")
    docs = prompts_for(256, [150, 150, 150], seed=5)
    with engines(ckpt, 1, max_kv_tokens_per_rank=320, kv_disk_dir=tmp_path / "kv") as llm:
        first = [_turn(llm, [p], ckpt)[0] for p in docs]
        llm.engine.sync_tiers(force=True)
        llm.engine.flush_tiers()
        t = _tiers(llm)
        assert t["disk"]["write_errors"] > 0 and t["disk"]["entries"] == 0 and t["disk"]["bytes"] == 0
        out = _turn(llm, [docs[0] + first[0].token_ids + [8]], ckpt)[0]
        assert out.num_cached_tokens == 0  # evicted, and the disk held nothing
        llm.engine.kv.check_invariants()
    assert caplog.text.count("writes are retried with backoff") == 1
    assert not list((tmp_path / "kv").glob("*.safetensors"))


def test_a_read_only_directory_is_read_and_never_written(ckpt, engines, tmp_path, monkeypatch, caplog):
    """Entries written by one engine are restored by the next one that cannot write there (logged once); it writes
    and deletes nothing."""
    from cpinfer.engine.kv import disk_dir

    d = tmp_path / "kv"
    docs = prompts_for(256, [150, 150], seed=6)
    with engines(ckpt, 1, max_kv_tokens_per_rank=2048, kv_disk_dir=d) as llm:
        first = _turn(llm, docs, ckpt)
    files = sorted((p.name, p.stat().st_mtime_ns) for p in d.glob("*.safetensors"))
    monkeypatch.setattr(disk_dir, "_probe_write", lambda path: False)
    caplog.set_level(logging.INFO, logger="cpinfer")
    with engines(ckpt, 1, max_kv_tokens_per_rank=320, kv_disk_dir=d) as llm:  # one chat on the device
        outs = _turn(llm, [p + o.token_ids + [3] for p, o in zip(docs, first)], ckpt)
        assert [o.num_cached_tokens for o in outs] == [len(p) + OUT - 1 for p in docs]
        assert _tiers(llm)["disk"]["writable"] is False
    assert caplog.text.count("is not writable") == 1
    assert sorted((p.name, p.stat().st_mtime_ns) for p in d.glob("*.safetensors")) == files


# ---------------------------------------------------------------------------------------------- the entry files
LAYOUT = Layout("a" * 64, "float32", 2, 2, 4, 1)


def _write(directory, layout=LAYOUT, entry="0" * 40, shard=0, cp=1, count=5, positions=None):
    """One entry file of a `count`-token segment at position 0; this shard's rows at `positions` (default all)."""
    positions = np.arange(count, dtype=np.int64) if positions is None else np.asarray(positions, dtype=np.int64)
    kv = torch.randn(len(positions), 2, layout.layers, layout.kv_heads, layout.head_dim,
                     generator=torch.Generator().manual_seed(0))
    path = np.arange(3, 3 + count, dtype=np.int64)
    header = EntryHeader(layout, entry, shard, cp, 0, 0, count, path, positions, 0)
    write_entry(directory, header, kv)
    return directory / file_name(entry, shard, 0), kv


def test_entry_files_keyed_checked_and_never_half_read(tmp_path):
    f, kv = _write(tmp_path)
    torch.testing.assert_close(read_rows(f, np.asarray([4, 0])), kv[[4, 0]])
    found, report = scan(tmp_path, LAYOUT)
    assert [e.name for e in found] == ["0" * 40] and not report.corrupt and not report.foreign
    # every key field that differs makes the entry foreign: model checksum, dtype, layers, KV heads, head size
    for other in (Layout("b" * 64, "float32", 2, 2, 4, 1), Layout("a" * 64, "bfloat16", 2, 2, 4, 1),
                  Layout("a" * 64, "float32", 3, 2, 4, 1), Layout("a" * 64, "float32", 2, 1, 4, 1),
                  Layout("a" * 64, "float32", 2, 2, 8, 1)):
        found, report = scan(tmp_path, other, remove=False)
        assert not found and report.foreign == [f.name]
    found, report = scan(tmp_path, Layout("a" * 64, "float32", 2, 2, 4, 2), remove=False)
    assert not found and report.other_tp == [f.name]
    # a flipped K/V byte: the header still scans, the rows are refused
    raw = bytearray(f.read_bytes())
    raw[-3] ^= 1
    f.write_bytes(bytes(raw))
    with pytest.raises(CorruptEntry):
        read_rows(f, np.asarray([0]))
    # a damaged header, a truncated file, a stranger: listed, never raised; the corrupt ones deleted
    g, _ = _write(tmp_path, entry="1" * 40)
    g.write_bytes(g.read_bytes()[:100])
    (tmp_path / "notes.txt").write_text("hello")
    h, _ = _write(tmp_path, entry="2" * 40)
    blob = bytearray(h.read_bytes())
    blob[blob.find(b'"pos0":"0"') + 8] = ord("1")  # pos0 0 -> 1 in the JSON header: its checksum fails
    h.write_bytes(bytes(blob))
    found, report = scan(tmp_path, LAYOUT)
    assert [e.name for e in found] == ["0" * 40]  # (its K/V damage is caught when its rows are read)
    assert sorted(c.split(" ")[0] for c in report.corrupt) == sorted([g.name, h.name])
    assert report.junk == ["notes.txt"] and not report.foreign
    assert not g.exists() and not h.exists() and (tmp_path / "notes.txt").exists()


def test_half_written_and_incomplete_entries_are_removed_at_scan(tmp_path, monkeypatch):
    """A write interrupted before its rename leaves only a temporary file; an entry missing one of its CP shards
    (a rank died before writing its own) is incomplete: both are deleted by the scan, neither is adopted."""
    _write(tmp_path, entry="3" * 40, shard=0, cp=2, count=4, positions=[0, 3])  # shard 1 never arrived

    def crash(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "rename", crash)
    with pytest.raises(KeyboardInterrupt):
        _write(tmp_path, entry="4" * 40)
    monkeypatch.undo()
    assert not list(tmp_path.glob(".tmp-*"))  # the writer removes its temporary file when it can
    (tmp_path / f".tmp-{file_name('5' * 40, 0, 0)}.123").write_bytes(b"half")  # ... and when it could not
    found, report = scan(tmp_path, LAYOUT)
    assert not found and len(report.removed) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == []
