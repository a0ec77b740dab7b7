"""`cpinfer serve`: an OpenAI-compatible HTTP server (FastAPI + uvicorn) over `AsyncLLM` on N context-parallel
(× M tensor-parallel) ranks. Multi-turn chats keep their KV cache sharded across turns (paper §3.3).

Locally the ranks are child processes of the server; under torchrun rank 0 serves HTTP and the other ranks serve
the engine (they never return from `AsyncLLM(...)`). SIGINT / SIGTERM end in-flight requests, stop every rank and
release the port (exit 0). A dead engine (a rank died or raised) closes in-flight responses and exits with code 1
so a supervisor restarts the server, unless --no-exit-on-engine-death.
"""
from __future__ import annotations

import argparse
import os
import signal
import threading

from cpinfer.bench.attention import positive_int
from cpinfer.device import add_arguments as add_device_arguments
from cpinfer.device import check_arguments as check_device_arguments
from cpinfer.device import engine_kwargs as device_kwargs
from cpinfer.server.reasoning import REASONING_PARSERS
from cpinfer.server.tool_parsers import TOOL_PARSERS
from cpinfer.utils import get_logger

log = get_logger()


def _port(text: str) -> int:
    value = int(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be in [0, 65535], got {value}")
    return value


def _gib(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of GiB") from None
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} must be a finite non-negative number of GiB")
    return value


def _rank_pids() -> list[int]:
    """PIDs of this process's direct children (the local ranks), read from /proc; [] where /proc is absent."""
    me, pids = os.getpid(), []
    try:
        entries = os.listdir("/proc")
    except OSError:
        return pids
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == me:
            pids.append(int(entry))
    return sorted(pids)


EXIT_ENGINE_DEAD = 1


def _watch_engine(engine, server, stop: threading.Event) -> None:
    """Stop uvicorn (gracefully: in-flight responses end with their error) once the engine is dead."""
    while not stop.wait(0.1):
        if engine.errored:
            log.error("the engine is dead (%s): closing in-flight responses and exiting with code %d",
                      engine.dead_error, EXIT_ENGINE_DEAD)
            server.should_exit = True
            return


def _run_until_signal(server) -> str:
    """Run uvicorn until SIGINT / SIGTERM; in-flight requests end first. uvicorn re-raises the signal it caught
    once it has stopped, to the handler that was installed before it: ours records it, so the process goes on to
    shut the ranks down and exit 0 instead of dying of the signal."""
    caught: list[int] = []
    previous = {sig: signal.signal(sig, lambda s, _frame: caught.append(s)) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        server.run()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return signal.Signals(caught[0]).name if caught else "server exit"


def _check_port_free(host: str, port: int) -> None:
    """Fail before the (slow) engine start when another process already listens on host:port."""
    import socket

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as exc:
            raise ValueError(f"cannot listen on {host}:{port}: {exc.strerror} (choose another --port)") from None


def engine_kwargs(args) -> dict:
    """`AsyncLLM` keyword arguments from the parsed command line."""
    kwargs = {"context_parallel_size": args.cp, "tensor_parallel_size": args.tp,
              "enable_prefix_caching": not args.no_prefix_caching, "strategy": args.strategy,
              "placement": args.placement, "hardware_profile": args.hardware_profile}
    optional = {"max_model_len": args.max_model_len, "max_num_batched_tokens": args.max_num_batched_tokens,
                "max_num_seqs": args.max_num_seqs, "max_kv_tokens_per_rank": args.max_kv_tokens_per_rank,
                "threads_per_rank": args.threads_per_rank, "kv_disk_dir": args.kv_disk_dir,
                "kv_disk_gib": args.kv_disk_gib, "max_logprobs": args.max_logprobs}
    if args.kv_host_gib:
        kwargs["kv_host_gib"] = args.kv_host_gib
    kwargs.update({k: v for k, v in optional.items() if v is not None})
    kwargs.update(device_kwargs(args))  # --device, --dtype, --attention-backend, --gpu-memory-utilization, ...
    return kwargs


def run(args) -> int:
    import uvicorn

    from cpinfer.engine import AsyncLLM
    from cpinfer.model.resolve import DEFAULT_MODEL_NAME, resolve_model
    from cpinfer.server.app import ServerConfig, build_app

    check_device_arguments(args)  # CUDA asked for and missing: exit 2 now, before the model or any rank
    api_key = args.api_key or os.environ.get("CPINFER_API_KEY") or None
    model_dir = resolve_model(args.model)  # ValueError naming the problem, before any rank starts
    name = args.served_model_name or (os.path.basename(os.path.normpath(args.model)) if args.model
                                      else DEFAULT_MODEL_NAME)
    config = ServerConfig(served_model_name=name, model_path=str(model_dir), api_key=api_key,
                          max_request_bytes=args.max_request_bytes,
                          allow_special_tokens_in_content=args.allow_special_tokens_in_content,
                          enable_docs=args.enable_docs, tool_call_parser=args.tool_call_parser,
                          reasoning_parser=args.reasoning_parser, stream_stall_timeout_s=args.stream_stall_timeout)
    if args.hardware_profile is not None:
        from cpinfer.perf.hardware import load_hardware_profile

        load_hardware_profile(args.hardware_profile)  # a bad name fails here
    if os.environ.get("RANK", "0") == "0":  # under torchrun only rank 0 listens
        _check_port_free(args.host, args.port)
    engine = AsyncLLM(str(model_dir), **engine_kwargs(args))  # under torchrun only rank 0 returns
    stop_watch = threading.Event()
    code = 0
    try:
        app = build_app(engine, config)
        server = uvicorn.Server(uvicorn.Config(
            app, host=args.host, port=args.port, log_level=args.log_level, access_log=args.access_log,
            timeout_graceful_shutdown=args.graceful_timeout, lifespan="off"))
        log.info("serving %s (%s) at http://%s:%d/v1 — CP=%d TP=%d (placement %s), max_model_len %d, prefix "
                 "caching %s, API key %s; rank pids %s", name, model_dir, args.host, args.port, args.cp, args.tp,
                 args.placement,
                 engine.max_model_len, "off" if args.no_prefix_caching else "on",
                 "required" if api_key else "off",
                 getattr(engine, "rank_pids", None) or _rank_pids())
        if args.exit_on_engine_death:
            threading.Thread(target=_watch_engine, args=(engine, server, stop_watch), daemon=True).start()
        stopped_by = _run_until_signal(server)
        if engine.errored and args.exit_on_engine_death:
            stopped_by, code = "engine death", EXIT_ENGINE_DEAD
        log.info("stopping on %s: shutting the engine down", stopped_by)
    finally:
        stop_watch.set()
        engine.shutdown()
        log.info("server stopped; every rank exited")
    return code


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "serve", help="OpenAI-compatible HTTP server over N context-parallel ranks", description=__doc__,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--model", default=None, metavar="PATH",
                        help="Hugging Face Llama checkpoint folder or .gguf file (default: the embedded "
                             "SmolLM2-135M-Instruct)")
    parser.add_argument("--cp", type=positive_int, default=1, help="context-parallel ranks")
    parser.add_argument("--tp", type=positive_int, default=1, help="tensor-parallel ranks per CP rank")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0 = every interface)")
    parser.add_argument("--port", type=_port, default=8000, help="TCP port")
    parser.add_argument("--served-model-name", default=None, metavar="NAME",
                        help="model name clients send and see in /v1/models (default: the last part of --model, "
                             "never a local path, or SmolLM2-135M-Instruct)")
    parser.add_argument("--max-model-len", type=positive_int, default=None, metavar="L",
                        help="longest prompt + completion in tokens (default: the model's context length)")
    parser.add_argument("--max-num-batched-tokens", type=positive_int, default=None, metavar="B",
                        help="tokens per forward; longer prompts are prefilled in chunks (partial prefill)")
    parser.add_argument("--max-num-seqs", type=positive_int, default=None, help="running requests at most")
    parser.add_argument("--max-logprobs", type=int, default=20,
                        help="the most alternatives per token a request may ask for (completions `logprobs`, chat "
                        "`top_logprobs`); -1: the whole vocabulary")
    parser.add_argument("--max-kv-tokens-per-rank", type=positive_int, default=None,
                        help="KV-cache capacity of each rank in tokens (default: CUDA: what "
                             "--gpu-memory-utilization leaves after the weights and a profiling forward; CPU: a "
                             "share of RAM)")
    parser.add_argument("--kv-host-gib", type=_gib, default=0.0, metavar="G",
                        help="host KV tier: GiB of host memory per CP rank that K/V evicted from the device cache "
                             "move to (pinned on CUDA), restored on a later prefix match instead of recomputed; "
                             "0: no host tier")
    parser.add_argument("--kv-disk-dir", default=None, metavar="D",
                        help="disk KV tier: a directory for evicted and finished K/V (one safetensors file per "
                             "CP shard, keyed by model checksum, dtype, layer layout and token path); the index is "
                             "rebuilt from it at start, so conversations keep their cache across restarts")
    parser.add_argument("--kv-disk-gib", type=_gib, default=None, metavar="G",
                        help="bound of the disk KV tier in GiB, least recently used entries deleted beyond it "
                             "(default: half the disk's free space at start)")
    parser.add_argument("--no-prefix-caching", action="store_true",
                        help="do not reuse K/V across requests (every turn re-prefills its whole history)")
    parser.add_argument("--strategy", choices=["auto", "pass-kv", "pass-q"], default="auto",
                        help="ring variant: auto = the paper's heuristic per forward, or force one")
    parser.add_argument("--placement", choices=["auto", "shard", "local"], default="auto",
                        help="where a request's KV goes: auto = one rank unless spreading over the CP ranks pays "
                             "(cost model), shard = always 2N-sharded over all ranks, local = always one rank")
    parser.add_argument("--hardware-profile", default=None, metavar="P",
                        help="hardware profile for the strategy and placement cost models (catalog name or "
                             "calibrate JSON)")
    parser.add_argument("--threads-per-rank", type=positive_int, default=None,
                        help="torch threads per rank (default: cores / ranks)")
    parser.add_argument("--api-key", default=None, metavar="KEY",
                        help="require 'Authorization: Bearer KEY' on every route but /health and /metrics "
                             "(or set CPINFER_API_KEY); checked before the request body is read")
    parser.add_argument("--max-request-bytes", type=positive_int, default=None, metavar="N",
                        help="largest request body accepted (413 beyond it, checked before the body is read; "
                             "default: 32 bytes per token of max_model_len, at least 1 MiB)")
    parser.add_argument("--allow-special-tokens-in-content", action="store_true",
                        help="let special-token text in chat message content ('<|im_end|>') become special tokens "
                             "(by default it is tokenized as plain text, so users cannot forge turns)")
    parser.add_argument("--tool-call-parser", choices=sorted(TOOL_PARSERS), default=None,
                        help="the model's tool-call format, parsed for tool_choice 'auto' (vLLM's names; default: "
                             "recognised in the chat template)")
    parser.add_argument("--reasoning-parser", choices=sorted(REASONING_PARSERS), default=None,
                        help="split <think> reasoning into reasoning_content (vLLM's names)")
    parser.add_argument("--enable-docs", action="store_true",
                        help="serve the OpenAPI schema at /openapi.json (off by default; no docs UI is served)")
    parser.add_argument("--exit-on-engine-death", action=argparse.BooleanOptionalAction, default=True,
                        help="when a rank dies or fails, close in-flight responses and exit with code 1 so a "
                             "supervisor restarts the server; --no-exit-on-engine-death keeps answering 503")
    parser.add_argument("--stream-stall-timeout", type=float, default=60.0, metavar="S",
                        help="a streaming client that takes no data for S seconds (it stopped reading) is "
                             "disconnected and its request aborted, freeing its KV cache")
    parser.add_argument("--graceful-timeout", type=positive_int, default=30, metavar="S",
                        help="on SIGINT / SIGTERM, seconds in-flight requests get to finish before they are "
                             "aborted")
    parser.add_argument("--log-level", choices=["critical", "error", "warning", "info", "debug"], default="info",
                        help="uvicorn log level")
    parser.add_argument("--access-log", action="store_true", help="log every HTTP request")
    add_device_arguments(parser)
    parser.set_defaults(func=run)
