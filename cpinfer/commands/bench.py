"""`cpinfer bench <name>`: a registry of benchmarks, one module per benchmark in `cpinfer.bench`.

Each benchmark module exposes `add_arguments(parser)` and `run(args) -> int`; names not built yet are skipped.
"""
from __future__ import annotations

import importlib

BENCHES = ["attention", "prefill", "decode", "decode-overhead", "shared-prefix", "chunked-prefill", "partial",
           "heuristic-quality", "cp-vs-tp", "serve", "gpu", "structured-output", "placement", "kv-tiers", "mla",
           "kv-fp8", "fp8-gemm", "detokenize", "pd", "spec", "sparse", "burst", "agent", "cpu-attention"]


def _load(name: str):
    module_name = f"cpinfer.bench.{name.replace('-', '_')}"
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name == module_name:
            return None  # benchmark not built yet
        raise


def register(subparsers) -> None:
    parser = subparsers.add_parser("bench", help="benchmarks (tables, --json)",
                                   description="Benchmarks: each prints a table; --json adds one JSON line.")
    sub = parser.add_subparsers(dest="bench", metavar="BENCH")
    for name in BENCHES:
        module = _load(name)
        if module is None:
            continue
        summary = (module.__doc__ or name).strip().splitlines()[0].replace("%", "%%")  # argparse %-formats help
        bench_parser = sub.add_parser(name, help=summary, description=module.__doc__)
        module.add_arguments(bench_parser)
        bench_parser.set_defaults(func=module.run)

    def no_bench(_args) -> int:
        parser.print_help()
        return 2

    parser.set_defaults(func=no_bench)
