"""Helpers shared by the engine benchmarks (`prefill`, `decode`, `partial`): random Llama-3-shaped checkpoints in a
cache folder, a quiet-machine wrapper around a measurement, and the report plumbing of `bench attention`.
"""
from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import sys
from pathlib import Path

from cpinfer.bench.attention import (DOC_PATH, ForeignCPU, _cp_sizes, _fmt_table, machine_info, machine_line,
                                     positive_int, write_doc_section)

__all__ = ["DOC_PATH", "ForeignCPU", "cp_sizes", "fmt_table", "machine_info", "machine_line", "positive_int",
           "write_doc_section", "add_common_arguments", "run_measured", "cache_dir", "random_model", "random_prompt",
           "measured", "finish_report", "hardware", "hardware_text", "hardware_flags"]

cp_sizes = _cp_sizes
fmt_table = _fmt_table


def cache_dir() -> Path:
    """$CPINFER_CACHE, else ~/.cache/cpinfer (created on demand)."""
    root = Path(os.environ.get("CPINFER_CACHE") or Path.home() / ".cache" / "cpinfer")
    root.mkdir(parents=True, exist_ok=True)
    return root


def random_model(name: str, seed: int = 0, **config) -> Path:
    """A random Llama-3-shaped checkpoint in the cache, written once per (shape, seed) and reused afterwards."""
    from cpinfer.model import write_random_checkpoint

    key = hashlib.sha1(json.dumps([seed, sorted(config.items())], default=str).encode()).hexdigest()[:10]
    path = cache_dir() / f"{name}-{key}"
    if not (path / "config.json").exists() or not (path / "model.safetensors").exists():
        tmp = path.with_name(path.name + f".tmp{os.getpid()}")
        write_random_checkpoint(tmp, seed=seed, **config)
        try:
            os.rename(tmp, path)  # atomic; fails if a concurrent writer got there first
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)
    return path


def random_prompt(n: int, vocab: int, seed: int = 0) -> list[int]:
    """n token ids in [3, vocab): avoids the special ids 0-2 (bos/eos of the random checkpoints)."""
    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(n)]


def measured(fn, *args):
    """Run fn(*args) and return (result, machine dict with load and foreign CPU share during the run)."""
    before = [round(x, 2) for x in os.getloadavg()]
    with ForeignCPU() as foreign:
        res = fn(*args)
    machine = machine_info()
    machine["load_avg_before"] = before
    machine["foreign_cpu_share"] = foreign.share
    return res, machine


def finish_report(args, res: dict, report: str, doc_key: str, title: str) -> None:
    """Print the report and machine line, warn when the machine was busy, write the doc section / JSON if asked."""
    machine = res["machine"]
    print(report)
    print(f"\n{machine_line(machine)}")
    share = machine.get("foreign_cpu_share")
    if share is not None and share > 0.05:
        print(f"warning: other processes used {100 * share:.0f}% of the machine during the run; "
              "the timings are disturbed", file=sys.stderr)
    if getattr(args, "write_doc", None):
        body = "\n".join([f"### {title}", "", "```", res["command"], "```", "", machine_line(machine), "",
                          report, ""])
        write_doc_section(args.write_doc, doc_key, body)
    if getattr(args, "json", False):
        print(json.dumps(res))


def run_measured(args, measure, format_report, doc_key: str, title) -> int:
    """The tail of every engine benchmark: measure while watching the machine, then print / write / JSON the report.

    `title` is the doc section's heading, or a function of the result that returns it.
    """
    if hasattr(args, "device"):
        hardware(args)  # a device the machine lacks: exit 2 before any checkpoint is written or rank started
    res, machine = measured(measure, args)
    res["machine"] = machine
    finish_report(args, res, format_report(res), doc_key, title(res) if callable(title) else title)
    return 0


def add_common_arguments(parser) -> None:
    """--json, --write-doc, and the hardware flags of `cpinfer.device` (--device, --dtype, --attention-backend,
    --gpu-memory-utilization, --share-gpus) that `hardware(args)` turns into `LLM` arguments."""
    parser.add_argument("--json", action="store_true", help="print the results as one JSON object on the last line")
    parser.add_argument("--write-doc", nargs="?", const=DOC_PATH, type=Path, metavar="FILE",
                        help=f"replace (or append) this run's section in FILE (default: {DOC_PATH})")
    from cpinfer.device import add_arguments

    add_arguments(parser)


def hardware(args) -> dict:
    """`LLM` keyword arguments of the hardware flags, resolved ("auto" → cpu / cuda, float32 / bfloat16): a
    device the machine lacks fails here, before any model is built or rank started."""
    from cpinfer.device import engine_kwargs, resolve_device, resolve_dtype

    kw = engine_kwargs(args)
    kw["device"] = resolve_device(kw["device"])
    kw["dtype"] = resolve_dtype(kw["dtype"], kw["device"])
    return kw


def hardware_text(hw: dict) -> str:
    """"cpu, float32" / "cuda (NVIDIA H100 ...), bfloat16, triton attention" for reports."""
    where = hw["device"]
    if where == "cuda":
        import torch

        where = f"cuda ({torch.cuda.get_device_name()})"
    backend = "" if hw.get("attention_backend", "auto") == "auto" else f", {hw['attention_backend']} attention"
    eager = ", no CUDA graphs" if hw.get("enforce_eager") and where != "cpu" else ""
    kv = ", FP8 KV cache" if hw.get("kv_cache_dtype", "auto") != "auto" else ""
    return f"{where}, {hw['dtype']}{kv}{backend}{eager}"


def hardware_flags(hw: dict) -> str:
    """The command-line flags that reproduce `hw` (empty for CPU float32 with the default backend)."""
    flags = "" if hw["device"] == "cpu" else f" --device {hw['device']}"
    if hw["dtype"] != ("float32" if hw["device"] == "cpu" else "bfloat16"):
        flags += f" --dtype {hw['dtype']}"
    if hw.get("attention_backend", "auto") != "auto":
        flags += f" --attention-backend {hw['attention_backend']}"
    if hw.get("enforce_eager"):
        flags += " --enforce-eager"
    if hw.get("kv_cache_dtype", "auto") != "auto":
        flags += f" --kv-cache-dtype {hw['kv_cache_dtype']}"
    return flags


def add_model_arguments(parser, *, hidden: int, layers: int, heads: int, kv_heads: int, ffn: int, vocab: int) -> None:
    """Shape of the random Llama-3-shaped model a benchmark builds (head_dim = hidden / heads)."""
    parser.add_argument("--hidden", type=positive_int, default=hidden, help=f"hidden size (default: {hidden})")
    parser.add_argument("--layers", type=positive_int, default=layers, help=f"decoder layers (default: {layers})")
    parser.add_argument("--heads", type=positive_int, default=heads, help=f"query heads (default: {heads})")
    parser.add_argument("--kv-heads", type=positive_int, default=kv_heads, help=f"KV heads (default: {kv_heads})")
    parser.add_argument("--ffn", type=positive_int, default=ffn, help=f"MLP intermediate size (default: {ffn})")
    parser.add_argument("--vocab", type=positive_int, default=vocab, help=f"vocabulary size (default: {vocab})")


def model_config(args, max_positions: int) -> dict:
    """config.json overrides for `random_model` from `add_model_arguments`' options; checks the head shape."""
    if args.hidden % args.heads or args.heads % args.kv_heads:
        raise ValueError(f"--hidden ({args.hidden}) must be a multiple of --heads ({args.heads}), and --heads of "
                         f"--kv-heads ({args.kv_heads})")
    positions = 1 << max(12, (max_positions - 1).bit_length())
    return dict(hidden_size=args.hidden, num_hidden_layers=args.layers, num_attention_heads=args.heads,
                num_key_value_heads=args.kv_heads, intermediate_size=args.ffn, vocab_size=args.vocab,
                max_position_embeddings=positions, rope_theta=500000.0)


def shape_text(cfg: dict, hw: dict | None = None) -> str:
    """The model shape, and where it ran (`hw` from `hardware`; default CPU fp32)."""
    return (f"hidden {cfg['hidden_size']}, {cfg['num_hidden_layers']} layers, {cfg['num_attention_heads']} heads x "
            f"{cfg['hidden_size'] // cfg['num_attention_heads']}, {cfg['num_key_value_heads']} KV heads, "
            f"ffn {cfg['intermediate_size']}, vocab {cfg['vocab_size']}, "
            f"{hardware_text(hw) if hw else 'fp32'}")


def kv_capacity(tokens: int) -> int:
    """A per-rank KV capacity (a multiple of the cache block) with room for `tokens` plus a small margin."""
    from cpinfer.engine.kv.manager import BLOCK

    return -(-(tokens + 4 * BLOCK) // BLOCK) * BLOCK
