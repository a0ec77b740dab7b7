"""The KV cache (paper §3.3, persistent KV): every CP rank keeps its shard of every sequence's K/V across turns.

```
 driver (one owner of every decision)                  │ each rank (applies what it is told, its own shard only)
                                                       │
 manager.KVManager ── prefix tree of token segments,   │ store.KVStore ── K/V tensors [layers, slots, Hkv, D]
   ref counts, LRU; the rank and slot of every new     │   written at the slots the batch names (model_runner)
   token  ◄── placement.Placer (1 rank or 2N chunks)   │
   tiers.Tiers ── which segments have host / disk      │ tier_store.RankTiers ── host pool, background disk
     copies; emits ops.CacheOp (ToHost, SaveEntry …) ──┼──►  writer; applies the CacheOps, reports TierEvents
   disk_dir ── open / lock / re-index the directory    │   disk_files ── one safetensors file per entry and shard
 capacity ── tokens per rank (host RAM or GPU memory)  │ fp8 ── e4m3 codecs of an FP8 cache (store, ring, tiers)
```

What crosses to the ranks is data only, inside each `ForwardBatch` (engine/batch.py): the new tokens' ranks and
slots, each sequence's cached slot runs, and the cache operations of `ops.py`, applied in order before the forward.
"""
from cpinfer.engine.kv.manager import BLOCK, KVManager, SeqKV
from cpinfer.engine.kv.store import KVStore, KVWidths
from cpinfer.engine.kv.tiers import TierConfig

__all__ = ["BLOCK", "KVManager", "SeqKV", "KVStore", "KVWidths", "TierConfig"]
