"""A Hugging Face Hub cache folder built by hand, in huggingface_hub's own layout, so Hub ids resolve with
HF_HUB_OFFLINE=1 and no network: `models--{org}--{name}/blobs/<sha256>` (the files' bytes),
`snapshots/<commit>/<file>` (relative symlinks to the blobs) and `refs/main` (the commit).
"""
from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def write_hub_cache(cache: Path, repo_id: str, source: Path, commit: str = COMMIT, branch: str = "main") -> Path:
    """Put every file of `source` into `cache` as the snapshot `commit` of model `repo_id`; returns the snapshot
    folder."""
    repo = Path(cache) / ("models--" + repo_id.replace("/", "--"))
    blobs, snapshot = repo / "blobs", repo / "snapshots" / commit
    blobs.mkdir(parents=True, exist_ok=True)
    snapshot.mkdir(parents=True, exist_ok=True)
    for f in sorted(Path(source).iterdir()):
        if not f.is_file():
            continue
        digest = hashlib.sha256(f.read_bytes()).hexdigest()
        if not (blobs / digest).exists():
            shutil.copyfile(f, blobs / digest)
        link = snapshot / f.name
        if not link.exists():
            os.symlink(os.path.relpath(blobs / digest, snapshot), link)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / branch).write_text(commit)
    return snapshot
