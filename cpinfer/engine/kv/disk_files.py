"""The disk tier's files: one safetensors file per (entry, CP shard, TP rank) holding, per token, its position and
the K/V of every layer (enough to place the token on any rank anew), keyed by what makes reuse safe.

Written to a temporary name, fsynced, renamed (a half-written entry is never read); a CRC32 over the tensors is
checked on every read, one over the header and token path when the directory is scanned at start.
"""
from __future__ import annotations

import dataclasses
import errno
import hashlib
import json
import os
import re
import time
import zlib
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

FORMAT = "cpinfer-kv/1"
SUFFIX = ".safetensors"
TMP_PREFIX = ".tmp-"
_NAME = re.compile(r"^(?P<entry>[0-9a-f]{40})\.s(?P<shard>\d+)\.t(?P<tp>\d+)" + re.escape(SUFFIX) + "$")
# errors that make the whole tier unusable (not just one entry): logged once, the tier is switched off
TIER_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM)
_WRITE_CHUNK = 16 << 20


@dataclasses.dataclass(frozen=True)
class Layout:
    """What must match for stored K/V to be reused: the weights (checksum), dtype and the layer layout. The CP
    rank layout is recorded per file (any CP size can re-place the tokens); TP must match."""

    model: str  # sha256 of the checkpoint's weights and config.json
    dtype: str
    layers: int
    kv_heads: int  # of the whole model (MLA: 1, the latent)
    head_dim: int  # channels of a cached key per KV head (MLA: kv_lora_rank + qk_rope_head_dim)
    tp: int
    kv_row: str = ""  # "" keys and values of head_dim each; MLA: "latent<rank>+rope<dims>" (values in the keys)

    @property
    def key(self) -> str:
        fields = {k: v for k, v in dataclasses.asdict(self).items() if k != "kv_row" or v}  # (old keys unchanged)
        return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:32]

    def same_but_tp(self, other: "Layout") -> bool:
        return dataclasses.replace(self, tp=other.tp) == other

    @property
    def tp_shared(self) -> bool:
        """Every TP rank caches the same rows (MLA's latent): one file per CP shard (TP rank 0's), read by every TP
        rank, at any TP size."""
        return bool(self.kv_row)


def entry_name(layout: Layout, path: np.ndarray, pos0: int) -> str:
    """The entry of a segment: tokens pos0 ... of the token path `path` (every token from the root through the
    segment's end, so the same tokens after another prefix never match), under one layout; plus a nonce, so a
    rewrite never replaces a file another generation of the index may name."""
    h = hashlib.sha256(layout.key.encode())
    h.update(np.int64(pos0).tobytes())
    h.update(np.ascontiguousarray(path, dtype=np.int64).tobytes())
    h.update(os.urandom(8))
    return h.hexdigest()[:40]


def file_name(entry: str, shard: int, tp_rank: int) -> str:
    return f"{entry}.s{shard}.t{tp_rank}{SUFFIX}"


def parse_name(name: str) -> tuple[str, int, int] | None:
    m = _NAME.match(name)
    return (m["entry"], int(m["shard"]), int(m["tp"])) if m else None


def _crc(tensors: dict[str, torch.Tensor], crc: int = 0) -> int:
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        raw = t.view(torch.uint8) if t.dtype != torch.uint8 else t  # bf16 / fp16 have no numpy type
        crc = zlib.crc32(raw.reshape(-1).numpy(), crc)
    return crc


def _head_crc(meta: dict, positions: torch.Tensor, path: torch.Tensor) -> int:
    text = json.dumps({k: v for k, v in meta.items() if k not in ("crc32", "head_crc32")}, sort_keys=True)
    return _crc({"path": path, "positions": positions}, zlib.crc32(text.encode()))


@dataclasses.dataclass(frozen=True)
class EntryHeader:
    """Everything about an entry file but its K/V (read at start without touching the K/V)."""

    layout: Layout
    entry: str
    shard: int  # the CP rank that wrote it, of `cp`
    cp: int
    tp_rank: int
    pos0: int  # the segment's first position
    count: int  # tokens of the whole segment (over every shard)
    path: np.ndarray  # [pos0 + count] int64 token ids from the root through the segment's end
    positions: np.ndarray  # [M] int64 positions of this file's rows, increasing
    nbytes: int  # file size
    states: tuple[int, ...] = ()  # hybrid models: positions of the recurrent-state snapshots this file carries


def state_key(pos: int, layer: int, part: str) -> str:
    """The tensor name of a recurrent-state snapshot's piece in an entry file (part "state" or "tail")."""
    return f"{part}.{pos}.{layer}"


def write_entry(directory: Path, header: EntryHeader, kv: torch.Tensor, delay_s: float = 0.0,
                states: dict[str, torch.Tensor] | None = None) -> int:
    """Write one file: kv [M, P, layers, Hkv, D] (CPU; P = 2 keys and values, 1 keys holding the values: MLA) with
    header.positions [M]; hybrid models: `states` (`state_key` -> fp32 state [H, Dk, Dv] / conv tail [K-1, C]) of
    the snapshots at header.states. Temporary name, fsync, rename,
    fsync of the directory. Returns the bytes written. delay_s: a pause between chunks (tests kill a writer
    mid-file with it)."""
    positions = torch.from_numpy(np.ascontiguousarray(header.positions, dtype=np.int64))
    path = torch.from_numpy(np.ascontiguousarray(header.path, dtype=np.int64))
    meta = {"format": FORMAT, "layout": json.dumps(dataclasses.asdict(header.layout), sort_keys=True),
            "entry": header.entry, "shard": str(header.shard), "cp": str(header.cp), "tp_rank": str(header.tp_rank),
            "pos0": str(header.pos0), "count": str(header.count)}
    if header.states:
        meta["states"] = json.dumps([int(p) for p in header.states])
    tensors = {"kv": kv.contiguous(), "positions": positions, "path": path}
    tensors.update({k: v.contiguous() for k, v in (states or {}).items()})
    meta["head_crc32"] = str(_head_crc(meta, positions, path))
    meta["crc32"] = str(_crc(tensors))
    blob = st_save(tensors, metadata=meta)
    name = file_name(header.entry, header.shard, header.tp_rank)
    tmp = directory / f"{TMP_PREFIX}{name}.{os.getpid()}"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            view = memoryview(blob)
            for a in range(0, len(view), _WRITE_CHUNK):
                os.write(fd, view[a:a + _WRITE_CHUNK])
                if delay_s:
                    time.sleep(delay_s)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(tmp, directory / name)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    _fsync_dir(directory)
    return len(blob)


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


class CorruptEntry(ValueError):
    """A file that is not a complete, intact entry of this format."""


def read_header(path: Path) -> EntryHeader:
    """The header, token path and row positions of one file (its K/V are not read); CorruptEntry when the file is
    not this format or its header checksum fails."""
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            if meta.get("format") != FORMAT:
                raise CorruptEntry(f"not a {FORMAT} file")
            positions, tokens = f.get_tensor("positions"), f.get_tensor("path")
            if int(meta["head_crc32"]) != _head_crc(meta, positions, tokens):
                raise CorruptEntry("header checksum mismatch")
            layout = Layout(**json.loads(meta["layout"]))
            return EntryHeader(layout, meta["entry"], int(meta["shard"]), int(meta["cp"]), int(meta["tp_rank"]),
                               int(meta["pos0"]), int(meta["count"]), tokens.numpy().astype(np.int64),
                               positions.numpy().astype(np.int64), path.stat().st_size,
                               tuple(json.loads(meta.get("states", "[]"))))
    except CorruptEntry:
        raise
    except Exception as exc:  # noqa: BLE001 - any unreadable file is corrupt for us, never a crash
        raise CorruptEntry(f"{type(exc).__name__}: {exc}") from None


def _read_checked(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a file, after checking the CRC over all of them (CorruptEntry when it fails or the file is
    unreadable)."""
    try:
        with open(path, "rb") as f:
            blob = f.read()
        tensors = st_load(blob)
        meta = _metadata(blob)
    except Exception as exc:  # noqa: BLE001
        raise CorruptEntry(f"{type(exc).__name__}: {exc}") from None
    if meta.get("format") != FORMAT or int(meta.get("crc32", -1)) != _crc(tensors):
        raise CorruptEntry("checksum mismatch")
    return tensors


def read_states(path: Path, pos: int) -> dict[str, torch.Tensor]:
    """The recurrent-state snapshot at `pos` in a file: `state_key(pos, layer, part)` -> tensor, after the CRC check
    (CorruptEntry when the file is damaged or holds no such snapshot)."""
    tensors = _read_checked(path)
    prefix = (f"state.{pos}.", f"tail.{pos}.")
    out = {k: v for k, v in tensors.items() if k.startswith(prefix)}
    if not out:
        raise CorruptEntry(f"no recurrent state at position {pos} in {path.name}")
    return out


def read_rows(path: Path, rows: np.ndarray) -> torch.Tensor:
    """rows [K] of a file's K/V → [K, 2, layers, Hkv, D], after checking the CRC over the whole file's tensors
    (CorruptEntry when it fails or the file is unreadable)."""
    kv = _read_checked(path)["kv"]
    if len(rows) and int(rows.max()) >= kv.shape[0]:
        raise CorruptEntry(f"row {int(rows.max())} beyond the file's {kv.shape[0]} rows")
    return kv[torch.from_numpy(np.asarray(rows, dtype=np.int64))]


def _metadata(blob: bytes) -> dict:
    n = int.from_bytes(blob[:8], "little")
    return json.loads(blob[8:8 + n]).get("__metadata__", {})


def model_checksum(files: list[Path], cache: Path | None = None) -> str:
    """sha256 over the checkpoint's weight files and config.json (their bytes), remembered in `cache` (a JSON
    file) by (path, size, mtime) so that a restart does not re-read gigabytes."""
    known = {}
    if cache is not None:
        try:
            known = json.loads(cache.read_text())
        except (OSError, ValueError):
            known = {}
    stamp = json.dumps([[str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns] for p in sorted(files)])
    if stamp in known:
        return known[stamp]
    h = hashlib.sha256()
    for p in sorted(files):
        with open(p, "rb") as f:
            while chunk := f.read(8 << 20):
                h.update(chunk)
    digest = h.hexdigest()
    if cache is not None:
        try:
            tmp = cache.with_name(cache.name + f".{os.getpid()}")
            tmp.write_text(json.dumps({**known, stamp: digest}))
            os.replace(tmp, cache)
        except OSError:
            pass
    return digest


@dataclasses.dataclass(frozen=True)
class FoundEntry:
    """A complete, intact entry found in the directory: per token of its segment, the shard file and row."""

    name: str
    cp: int
    pos0: int
    path: np.ndarray  # [pos0 + count] int64
    shard: np.ndarray  # [count] int64
    row: np.ndarray  # [count] int64
    shards: tuple[int, ...]
    nbytes: int
    mtime: float
    states: dict = dataclasses.field(default_factory=dict)  # hybrid models: snapshot position -> shard holding it


@dataclasses.dataclass
class ScanReport:
    """What a scan saw besides usable entries (the engine logs it)."""

    corrupt: list[str] = dataclasses.field(default_factory=list)  # "name (why)": our name, unreadable or damaged
    junk: list[str] = dataclasses.field(default_factory=list)  # files whose name is not an entry's
    foreign: list[str] = dataclasses.field(default_factory=list)  # intact entries of another model or layout
    other_tp: list[str] = dataclasses.field(default_factory=list)
    removed: list[str] = dataclasses.field(default_factory=list)  # half-written or incomplete entries of ours


def scan(directory: Path, layout: Layout, remove: bool = True) -> tuple[list[FoundEntry], ScanReport]:
    """Every usable entry of `layout` in directory, checking each file's header checksum. Temporary files, corrupt
    entry files and entries missing a shard (a crash mid-write) are deleted when `remove`; junk and other layouts'
    entries are listed (the caller counts or quarantines them)."""
    report = ScanReport()
    groups: dict[str, list[tuple[Path, EntryHeader]]] = {}
    for path in sorted(directory.iterdir()):
        name = path.name
        if name.startswith(TMP_PREFIX):
            report.removed.append(name)
            _unlink(path, remove)
            continue
        if name.startswith(".") or not path.is_file():
            continue  # the lock and the checksum cache
        if parse_name(name) is None:
            report.junk.append(name)
            continue
        try:
            header = read_header(path)
        except CorruptEntry as exc:
            report.corrupt.append(f"{name} ({exc})")
            _unlink(path, remove)
            continue
        if header.layout != layout and not (layout.tp_shared and header.layout.same_but_tp(layout)
                                             and header.tp_rank == 0):
            (report.other_tp if header.layout.same_but_tp(layout) else report.foreign).append(name)
            continue
        groups.setdefault(header.entry, []).append((path, header))
    found = []
    for entry, files in groups.items():
        got = _assemble(entry, [h for _, h in files], 1 if layout.tp_shared else layout.tp)
        if got is None:
            report.removed.extend(p.name for p, _ in files)
            for p, _ in files:
                _unlink(p, remove)
            continue
        found.append(dataclasses.replace(got, mtime=max(p.stat().st_mtime for p, _ in files)))
    return found, report


def _assemble(entry: str, headers: list[EntryHeader], tp: int) -> FoundEntry | None:
    """The entry's files agree and cover every position of the segment on every TP rank; else None."""
    h0 = headers[0]
    count = h0.count
    shard = np.full(count, -1, dtype=np.int64)
    row = np.full(count, -1, dtype=np.int64)
    seen: dict[int, set[int]] = {}
    states: dict[int, int] = {}
    for h in headers:
        if (h.cp, h.pos0, h.count) != (h0.cp, h0.pos0, h0.count) or not np.array_equal(h.path, h0.path):
            return None
        if len(h.path) != h.pos0 + count or not 0 <= h.shard < h.cp:
            return None
        seen.setdefault(h.shard, set()).add(h.tp_rank)
        if h.tp_rank:
            continue
        states.update((int(p), h.shard) for p in h.states if h.pos0 < p <= h.pos0 + count)
        idx = h.positions - h.pos0
        if len(idx) and (idx.min() < 0 or idx.max() >= count or (shard[idx] >= 0).any()):
            return None
        shard[idx] = h.shard
        row[idx] = np.arange(len(idx))
    if (shard < 0).any() or any(ranks != set(range(tp)) for ranks in seen.values()):
        return None
    return FoundEntry(entry, h0.cp, h0.pos0, h0.path, shard, row, tuple(sorted(seen)),
                      sum(h.nbytes for h in headers), 0.0, states)


def _unlink(path: Path, remove: bool) -> None:
    if remove:
        try:
            path.unlink()
        except OSError:
            pass
