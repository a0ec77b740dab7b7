"""Opening the disk tier's directory at start (driver): lock it, check it is writable, fingerprint the model, and
rebuild the index from the entry files there — a different CP size re-places their tokens; files of another model,
layout or TP size, and corrupt ones, are skipped with a warning; half-written ones are removed.
"""
from __future__ import annotations

import dataclasses
import os
import shutil
import time
from pathlib import Path

import numpy as np

from cpinfer.cp.sharding import chunk_ranks
from cpinfer.engine.kv.disk_files import Layout, file_name, model_checksum, scan
from cpinfer.engine.kv.tiers import DiskEntry
from cpinfer.utils import get_logger

log = get_logger()
_GIB = float(1 << 30)
QUARANTINE = ".quarantine"


@dataclasses.dataclass
class DiskDir:
    """An opened disk-tier directory: its lock (held while the engine lives), writability and byte bound."""

    path: Path
    writable: bool
    bound: int
    _lock: object = None

    def close(self) -> None:
        if self._lock is not None:
            self._lock.close()  # closing the file releases the flock
            self._lock = None


def open_disk_dir(directory: str, gib: float | None) -> DiskDir:
    """Create / lock the directory. ValueError when it cannot be used at all or another engine holds it; a
    read-only directory is opened for reading (logged once). gib None: half the free space (plus what the
    entries there take)."""
    path = Path(directory).expanduser().resolve()
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ValueError(f"kv_disk_dir {directory!r} cannot be created: {exc.strerror}") from None
    if not path.is_dir():
        raise ValueError(f"kv_disk_dir {directory!r} is not a directory")
    lock = _lock(path)
    writable = _probe_write(path)
    if not writable:
        log.error("KV disk tier: %s is not writable; its entries are read, none are written", path)
    ours = sum(p.stat().st_size for p in path.glob("*.safetensors") if p.is_file())
    ours += sum(p.stat().st_size for p in (path / QUARANTINE).glob("*") if p.is_file())
    bound = int(gib * (1 << 30)) if gib is not None else int(shutil.disk_usage(path).free // 2 + ours)
    return DiskDir(path, writable, bound, lock)


def _lock(path: Path):
    import fcntl

    try:
        f = open(path / ".lock", "a")
    except OSError:
        return None  # a read-only directory: nobody can write in it anyway
    try:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        f.close()
        raise ValueError(f"kv_disk_dir {str(path)!r} is in use by another cpinfer engine") from None
    return f


def _probe_write(path: Path) -> bool:
    probe = path / f".probe-{os.getpid()}"
    try:
        with open(probe, "wb") as f:
            f.write(b"x")
            os.fsync(f.fileno())
        probe.unlink()
        return True
    except OSError:
        return False


def model_layout(model_dir: str, weight_files: list[Path], disk: DiskDir, dtype: str, layers: int, kv_heads: int,
                 head_dim: int, tp: int, kv_row: str = "") -> Layout:
    """The layout entries are keyed by; the weights' checksum is remembered in the directory."""
    t0 = time.perf_counter()
    files = list(weight_files) + [p for p in [Path(model_dir) / "config.json"] if p.exists()]
    cache = disk.path / ".model-checksums.json" if disk.writable else None
    digest = model_checksum(files, cache)
    log.debug("model checksum %s in %.2fs", digest[:12], time.perf_counter() - t0)
    return Layout(digest, dtype, layers, kv_heads, head_dim, tp, kv_row)


def rebuild_index(kv, disk: DiskDir, layout: Layout) -> None:
    """Adopt every usable entry of the directory into the KV manager's tree (off the device, restorable), oldest
    prefixes first; then trim to the byte bound, least recently written first."""
    tiers, n = kv.tiers, kv.n
    found, report = scan(disk.path, layout, remove=disk.writable)
    for name in report.corrupt[:5]:
        log.warning("KV disk tier: corrupt file %s %s", name, "removed" if disk.writable else "skipped")
    if len(report.corrupt) > 5:
        log.warning("KV disk tier: ... and %d more corrupt files", len(report.corrupt) - 5)
    if report.junk:
        log.warning("KV disk tier: %d file(s) in %s are not KV entries (e.g. %s): %s", len(report.junk), disk.path,
                    report.junk[0], f"moved to {QUARANTINE}/, deleted first when room is needed" if disk.writable
                    else "skipped")
    if report.foreign:
        log.warning("KV disk tier: keeping %d entry file(s) of another model or layout in %s (counted against the "
                    "bound, deleted first when room is needed)", len(report.foreign), disk.path)
    if report.other_tp:
        log.warning("KV disk tier: ignoring %d file(s) written at another tensor-parallel size", len(report.other_tp))
    for name in report.foreign + report.other_tp:
        _count_stray(tiers, disk.path / name)
    if disk.writable:
        for name in report.junk:
            _quarantine(tiers, disk.path, name)
    if report.removed:
        log.info("KV disk tier: removed %d half-written or incomplete file(s)", len(report.removed))
    for p in sorted((disk.path / QUARANTINE).glob("*")):  # quarantined by an earlier start, still counted
        if p.is_file():
            _count_stray(tiers, p)
    adopted, replaced, now_wall, now = 0, 0, time.time(), time.monotonic()
    for f in sorted(found, key=lambda f: (f.pos0, -f.mtime)):
        ranks = f.shard.copy() if f.cp == n else _replace(f.shard, n)
        replaced += f.cp != n
        entry = DiskEntry(f.name, f.cp, f.shards, f.nbytes, now - (now_wall - f.mtime), states=dict(f.states))
        if kv.adopt(entry, f.path, f.pos0, ranks, f.shard, f.row, entry.last_access):
            tiers.entries[f.name] = entry
            tiers.disk_used += f.nbytes
            adopted += 1
        elif disk.writable:  # its prefix is gone or another entry holds the same tokens: unusable
            for shard in f.shards:
                for t in range(layout.tp):
                    _unlink(disk.path, f.name, shard, t)
    if replaced:
        log.info("KV disk tier: %d entries were written at another CP size; their tokens are re-placed over %d "
                 "ranks", replaced, n)
    tiers.trim()
    log.info("KV disk tier %s: %d entries adopted (%d kept), %.2f GiB of %.2f GiB", disk.path, adopted,
             len(tiers.entries), tiers.disk_used / _GIB, tiers.config.disk_bytes / _GIB)


def _count_stray(tiers, path: Path) -> None:
    try:
        nbytes = path.stat().st_size
    except OSError:
        return
    tiers.stray[str(path)] = nbytes
    tiers.disk_used += nbytes


def _quarantine(tiers, directory: Path, name: str) -> None:
    """Move a file that is no KV entry out of the way (never deleting what someone may want at once); its bytes
    count against the bound until room is needed."""
    target = directory / QUARANTINE / name
    try:
        target.parent.mkdir(exist_ok=True)
        os.replace(directory / name, target)
    except OSError:
        return
    _count_stray(tiers, target)


def _replace(shard: np.ndarray, n: int) -> np.ndarray:
    """Restore ranks for tokens written at another CP size: a segment that was on one rank stays on one rank,
    a spread one is 2N-chunk sharded over the n ranks."""
    held = np.unique(shard)
    if len(held) == 1:
        return np.full(len(shard), int(held[0]) % n, dtype=np.int64)
    return chunk_ranks(len(shard), n, list(range(n)))


def _unlink(directory: Path, entry: str, shard: int, tp_rank: int) -> None:
    try:
        (directory / file_name(entry, shard, tp_rank)).unlink()
    except OSError:
        pass
