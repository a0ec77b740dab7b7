"""`cpinfer serve`: an OpenAI-compatible HTTP server (FastAPI + uvicorn) over `AsyncLLM` on N context-parallel
(× M tensor-parallel) ranks. Multi-turn chats keep their KV cache sharded across turns (paper §3.3).

Locally the ranks are child processes of the server; over several nodes (--nnodes, or under torchrun) rank 0 serves
HTTP and the other ranks serve the engine (they never return from `AsyncLLM(...)`; --headless nodes run ranks only). SIGINT / SIGTERM end in-flight requests, stop every rank and
release the port (exit 0). A dead engine (a rank died or raised) closes in-flight responses and exits with code 1
so a supervisor restarts the server, unless --no-exit-on-engine-death.
"""
from __future__ import annotations

import argparse
import os
import signal
import threading

from cpinfer import __version__, multinode
from cpinfer.bench.attention import positive_int
from cpinfer.commands.model_args import (HelpFormatter, add_model_arguments, add_pd_arguments,
                                         add_speculative_argument, engine_model_kwargs, model_name, resolve_args)
from cpinfer.device import add_arguments as add_device_arguments
from cpinfer.device import check_arguments as check_device_arguments
from cpinfer.device import engine_kwargs as device_kwargs
from cpinfer.engine.scheduler import DEFAULT_MAX_NUM_BATCHED_TOKENS
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


def _non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}")
    return value


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a non-negative number of seconds, got {text!r}")
    return value


def _json_list(text: str) -> list[str]:
    import json

    try:
        value = json.loads(text)
    except ValueError:
        value = None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise argparse.ArgumentTypeError(f"expected a JSON list of strings such as '[\"*\"]', got {text!r}")
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

_SEE = "see docs/serving.md, Coming from vLLM"
# vLLM's options that `serve` does not take, each refused with why and what to give instead (docs/serving.md)
VLLM_UNSUPPORTED = {
    **dict.fromkeys(("--pipeline-parallel-size", "-pp"), "vLLM's; pipeline parallelism is not supported: use --cp "
                                                         "and -tp"),
    **dict.fromkeys(("--data-parallel-size", "-dp"), "vLLM's; data parallelism is not supported: run one server "
                                                     "per replica"),
    "--quantization": "vLLM's; not supported: the checkpoint's own format decides",
    **dict.fromkeys(("--enable-lora", "--lora-modules"), "vLLM's; LoRA adapters are not supported"),
    "--trust-remote-code": "vLLM's; no remote code runs: only the families in docs/models.md",
    "--tokenizer-mode": f"vLLM's; not supported ({_SEE})",
    "--tokenizer-revision": f"vLLM's; not supported ({_SEE})",
    "--block-size": "vLLM's; not supported: the KV cache's block size is fixed",
    "--limit-mm-per-prompt": "vLLM's; not supported: text only",
    **dict.fromkeys(("--task", "--runner"), "vLLM's; not supported: generation only"),
    "--uvicorn-log-level": "vLLM's name: use --log-level",
    "--disable-uvicorn-access-log": "vLLM's; cpinfer logs no access lines unless --access-log",
    **dict.fromkeys(("--decode-context-parallel-size", "-dcp"), "vLLM's name: use --cp (context parallelism for "
                                                                "prefill and decode)"),
    "--swap-space": "vLLM's; use --kv-host-gib (a host tier for evicted K/V)",
    "--enable-chunked-prefill": "vLLM's; chunked prefill is always on: --max-num-batched-tokens sets the chunk",
}


def _watch_engine(engine, server, stop: threading.Event) -> None:
    """Stop uvicorn (gracefully: in-flight responses end with their error) once the engine is dead."""
    while not stop.wait(0.1):
        if engine.errored:
            log.error("the engine is dead (%s): closing in-flight responses and exiting with code %d",
                      engine.dead_error, EXIT_ENGINE_DEAD)
            server.should_exit = True
            return


def cut_after(graceful_timeout: float) -> float:
    """Seconds into a graceful shutdown at which requests still running are aborted: 5 s before uvicorn would
    cancel them (half the timeout when that is shorter), so each ends with its final chunk rather than mid-body."""
    return max(graceful_timeout - 5.0, graceful_timeout / 2)


def _cut_at_graceful_timeout(engine, server, stop: threading.Event, after_s: float) -> None:
    """Once uvicorn is stopping, wait `after_s`, then end every request still running with finish_reason "abort"
    (a stream then sends its last chunk and [DONE]; a whole response is returned with what was generated)."""
    while not server.should_exit:
        if stop.wait(0.1):
            return
    if not stop.wait(after_s):
        count = engine.abort_all()
        if count:
            log.warning("the graceful shutdown timeout is near: %d request(s) still running are aborted", count)


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
              "enable_prefix_caching": args.enable_prefix_caching, "strategy": args.strategy,
              "placement": args.placement, "hardware_profile": args.hardware_profile}
    optional = {"max_model_len": args.max_model_len, "max_num_batched_tokens": args.max_num_batched_tokens,
                "max_num_seqs": args.max_num_seqs, "max_kv_tokens_per_rank": args.max_kv_tokens_per_rank,
                "threads_per_rank": args.threads_per_rank, "kv_disk_dir": args.kv_disk_dir,
                "kv_disk_gib": args.kv_disk_gib, "max_logprobs": args.max_logprobs,
                "state_snapshot_interval": getattr(args, "state_snapshot_interval", None),
                "pd_decode_cp": getattr(args, "pd_decode_cp", None),  # prefill / decode groups
                "pd_decode_groups": getattr(args, "pd_decode_groups", None)}
    if args.kv_host_gib:
        kwargs["kv_host_gib"] = args.kv_host_gib
    if getattr(args, "speculative_config", None) is not None:
        kwargs["speculative_config"] = args.speculative_config
    kwargs.update({k: v for k, v in optional.items() if v is not None})
    kwargs.update(device_kwargs(args))  # --device, --dtype, --attention-backend, --gpu-memory-utilization, ...
    return kwargs


def served_name(args, model: str | None) -> str:
    """--served-model-name, else the Hub id as given (as vLLM), else the folder / file name (never a path)."""
    from cpinfer.model.resolve import DEFAULT_MODEL_NAME, is_hub_id

    if args.served_model_name:
        return args.served_model_name
    if model is None:
        return DEFAULT_MODEL_NAME
    if is_hub_id(model) and not os.path.exists(model):
        return model
    return os.path.basename(os.path.normpath(model))


def chat_template(value: str | None) -> str | None:
    """--chat-template: a file's text, else the string itself (it must look like a Jinja template)."""
    if value is None:
        return None
    path = os.path.expanduser(value)
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            return f.read()
    if "{{" not in value and "{%" not in value:
        raise ValueError(f"--chat-template {value!r}: no such file, and not a Jinja template either (give a "
                         "template file or the template text)")
    return value


def _check_tls(args) -> None:
    if (args.ssl_keyfile is None) != (args.ssl_certfile is None):
        raise ValueError("--ssl-keyfile and --ssl-certfile go together: give both to serve HTTPS, or neither")
    for flag, path in (("--ssl-keyfile", args.ssl_keyfile), ("--ssl-certfile", args.ssl_certfile)):
        if path is not None and not os.path.isfile(path):
            raise ValueError(f"{flag} {path}: no such file")


def server_config(args, name: str, model_dir, api_key: str | None) -> "ServerConfig":
    from cpinfer.server.app import ServerConfig

    return ServerConfig(served_model_name=name, model_path=str(model_dir), api_key=api_key,
                        max_request_bytes=args.max_request_bytes,
                        allow_special_tokens_in_content=args.allow_special_tokens_in_content,
                        enable_docs=args.enable_docs, tool_call_parser=args.tool_call_parser,
                        reasoning_parser=args.reasoning_parser, stream_stall_timeout_s=args.stream_stall_timeout,
                        chat_template=chat_template(args.chat_template), allowed_origins=args.allowed_origins,
                        log_requests=args.enable_log_requests, responses_max_stored=args.responses_max_stored,
                        responses_max_stored_bytes=args.responses_max_stored_mib << 20)


def run(args) -> int:
    import uvicorn

    from cpinfer.engine import AsyncLLM
    from cpinfer.server.app import build_app
    from cpinfer.server.metrics import StatsLogger

    check_device_arguments(args)  # CUDA asked for and missing: exit 2 now, before the model or any rank
    _check_tls(args)
    kwargs = engine_kwargs(args)
    node = multinode.spec_from_args(args, kwargs)  # bad multi-node flags fail before the model is read
    api_key = args.api_key or os.environ.get("CPINFER_API_KEY") or None
    model_dir, tokenizer_dir = resolve_args(args)  # ValueError naming the problem, before any rank starts
    kwargs.update(engine_model_kwargs(args, tokenizer_dir))
    if node is not None and node.headless:  # this node's ranks only: no HTTP
        return multinode.run_headless(node, str(model_dir), kwargs)
    name = served_name(args, model_name(args))
    config = server_config(args, name, model_dir, api_key)
    if args.hardware_profile is not None:
        from cpinfer.perf.hardware import load_hardware_profile

        load_hardware_profile(args.hardware_profile)  # a bad name fails here
    if os.environ.get("RANK", "0") == "0":  # under torchrun only rank 0 listens
        _check_port_free(args.host, args.port)
    node_ranks = None if node is None else multinode.start_driver(node, str(model_dir), kwargs)
    try:  # under torchrun only rank 0 returns
        engine = AsyncLLM(str(model_dir), **kwargs)
    except BaseException:
        if node_ranks is not None:
            node_ranks.close(force=True)
        raise
    stop_watch = threading.Event()
    code = 0
    try:
        app = build_app(engine, config)
        server = uvicorn.Server(uvicorn.Config(
            app, host=args.host, port=args.port, log_level=args.log_level, access_log=args.access_log,
            timeout_graceful_shutdown=args.graceful_timeout, lifespan="off", root_path=args.root_path or "",
            ssl_keyfile=args.ssl_keyfile, ssl_certfile=args.ssl_certfile))
        scheme = "https" if args.ssl_certfile else "http"
        log.info("serving %s (%s) at %s://%s:%d%s/v1 — CP=%d TP=%d (placement %s), max_model_len %d, prefix "
                 "caching %s, API key %s; rank pids %s", name, model_dir, scheme, args.host, args.port,
                 args.root_path or "", args.cp, args.tp, args.placement, engine.max_model_len,
                 "on" if args.enable_prefix_caching else "off", "required" if api_key else "off",
                 getattr(engine, "rank_pids", None) or _rank_pids())
        if args.exit_on_engine_death:
            threading.Thread(target=_watch_engine, args=(engine, server, stop_watch), daemon=True).start()
        threading.Thread(target=_cut_at_graceful_timeout, daemon=True,
                         args=(engine, server, stop_watch, cut_after(args.graceful_timeout))).start()
        if args.stats_interval > 0 and not args.disable_log_stats:
            stats = StatsLogger(engine.stats, args.stats_interval)
            threading.Thread(target=stats.run, args=(stop_watch,), daemon=True).start()
        stopped_by = _run_until_signal(server)
        if engine.errored and args.exit_on_engine_death:
            stopped_by, code = "engine death", EXIT_ENGINE_DEAD
            if node is not None:
                log.error("multi-node: the world of %d ranks over %d nodes lost a rank (a node stopped or a rank "
                          "failed): restart every node", node.world_size, node.nnodes)
        log.info("stopping on %s: shutting the engine down", stopped_by)
    finally:
        stop_watch.set()
        engine.shutdown()
        if node_ranks is not None:  # this node's other ranks leave the ended world
            node_ranks.close()
        log.info("server stopped; every rank exited")
    return code


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "serve", help="OpenAI-compatible HTTP server over N context-parallel ranks", description=__doc__,
        formatter_class=HelpFormatter, usage="%(prog)s [MODEL] [options]")
    parser.add_argument("--version", action="version", version=f"cpinfer {__version__}")
    add_model_arguments(parser, "Hugging Face checkpoint folder, .gguf file or Hugging Face Hub id (org/name) "
                                "(default: the embedded SmolLM2-135M-Instruct)")
    _frontend_arguments(parser)
    _parallel_arguments(parser)
    _cache_arguments(parser)
    _scheduler_arguments(parser)
    add_speculative_argument(parser)
    _observability_arguments(parser)
    add_device_arguments(parser)
    multinode.add_arguments(parser)
    parser.set_defaults(func=run)
    parser.unsupported = VLLM_UNSUPPORTED


def _frontend_arguments(parser) -> None:
    g = parser.add_argument_group("frontend", "the HTTP server and the OpenAI API")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0 = every interface)")
    g.add_argument("--port", type=_port, default=8000, help="TCP port")
    g.add_argument("--served-model-name", default=None, metavar="NAME",
                   help="model name clients send and see in /v1/models (default: the Hub id as given, else the "
                        "last part of the folder or file name, never a local path, or SmolLM2-135M-Instruct)")
    g.add_argument("--api-key", default=None, metavar="KEY",
                   help="require 'Authorization: Bearer KEY' on every route but /health, /metrics and /version "
                        "(or set CPINFER_API_KEY); checked before the request body is read")
    g.add_argument("--allowed-origins", type=_json_list, default=None, metavar="JSON",
                   help='browser origins allowed by CORS, as a JSON list such as \'["https://example.com"]\' or '
                        '\'["*"]\' (default: none, no CORS headers are sent)')
    g.add_argument("--root-path", default=None, metavar="PATH",
                   help="URL prefix the server sits under behind a path-based proxy (ASGI root_path)")
    g.add_argument("--ssl-keyfile", default=None, metavar="FILE", help="TLS private key file (serve HTTPS)")
    g.add_argument("--ssl-certfile", default=None, metavar="FILE", help="TLS certificate file (serve HTTPS)")
    g.add_argument("--chat-template", default=None, metavar="T",
                   help="the chat template to use instead of the tokenizer's: a Jinja file, or the template "
                        "itself as a string")
    g.add_argument("--max-logprobs", type=int, default=20,
                   help="the most alternatives per token a request may ask for (completions `logprobs`, chat "
                        "`top_logprobs`); -1: the whole vocabulary")
    g.add_argument("--max-request-bytes", type=positive_int, default=None, metavar="N",
                   help="largest request body accepted (413 beyond it, checked before the body is read; "
                        "default: 32 bytes per token of max_model_len, at least 1 MiB)")
    g.add_argument("--allow-special-tokens-in-content", action="store_true",
                   help="let special-token text in chat message content ('<|im_end|>') become special tokens "
                        "(by default it is tokenized as plain text, so users cannot forge turns)")
    g.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="accepted for vLLM command lines: tool_choice 'auto' is always on here")
    g.add_argument("--tool-call-parser", choices=sorted(TOOL_PARSERS), default=None,
                   help="the model's tool-call format, parsed for tool_choice 'auto' (vLLM's names; default: "
                        "recognised in the chat template)")
    g.add_argument("--reasoning-parser", choices=sorted(REASONING_PARSERS), default=None,
                   help="split <think> reasoning into reasoning_content (vLLM's names)")
    g.add_argument("--enable-docs", action="store_true",
                   help="serve the OpenAPI schema at /openapi.json (off by default; no docs UI is served)")
    g.add_argument("--exit-on-engine-death", action=argparse.BooleanOptionalAction, default=True,
                   help="when a rank dies or fails, close in-flight responses and exit with code 1 so a "
                        "supervisor restarts the server; --no-exit-on-engine-death keeps answering 503")
    g.add_argument("--stream-stall-timeout", type=float, default=60.0, metavar="S",
                   help="a streaming client that takes no data for S seconds (it stopped reading) is "
                        "disconnected and its request aborted, freeing its KV cache")
    g.add_argument("--responses-max-stored", type=int, default=1000, metavar="N",
                   help="POST /v1/responses keeps at most N stored responses (their conversations) for "
                        "previous_response_id; the oldest are evicted first (0: keep none)")
    g.add_argument("--responses-max-stored-mib", type=int, default=256, metavar="MIB",
                   help="... and at most MIB mebibytes of them (their JSON)")
    g.add_argument("--graceful-timeout", type=positive_int, default=30, metavar="S",
                   help="on SIGINT / SIGTERM, seconds in-flight requests get to finish before they are aborted")


def _parallel_arguments(parser) -> None:
    g = parser.add_argument_group("parallel", "context and tensor parallelism")
    g.add_argument("--cp", "--context-parallel-size", dest="cp", type=positive_int, default=1,
                   help="context-parallel ranks")
    g.add_argument("-tp", "--tensor-parallel-size", "--tp", dest="tp", type=positive_int, default=1,
                   help="tensor-parallel ranks per CP rank")
    add_pd_arguments(g)
    g.add_argument("--strategy", choices=["auto", "pass-kv", "pass-q"], default="auto",
                   help="ring variant: auto = the paper's heuristic per forward, or force one")
    g.add_argument("--placement", choices=["auto", "shard", "local"], default="auto",
                   help="where a request's KV goes: auto = one rank unless spreading over the CP ranks pays "
                        "(cost model), shard = always 2N-sharded over all ranks, local = always one rank")
    g.add_argument("--hardware-profile", default=None, metavar="P",
                   help="hardware profile for the strategy and placement cost models (catalog name or "
                        "calibrate JSON)")
    g.add_argument("--threads-per-rank", type=positive_int, default=None,
                   help="torch threads per rank (default: cores / ranks)")


def _cache_arguments(parser) -> None:
    g = parser.add_argument_group("cache", "the KV cache and its tiers")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="reuse K/V across requests (earlier turns, shared documents); --no-enable-prefix-caching "
                        "(or --no-prefix-caching) makes every turn re-prefill its whole history")
    g.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false",
                   help="the same as --no-enable-prefix-caching")
    g.add_argument("--max-kv-tokens-per-rank", type=positive_int, default=None,
                   help="KV-cache capacity of each rank in tokens (default: CUDA: what --gpu-memory-utilization "
                        "leaves after the weights and a profiling forward; CPU: a share of RAM)")
    g.add_argument("--kv-host-gib", type=_gib, default=0.0, metavar="G",
                   help="host KV tier: GiB of host memory per CP rank that K/V evicted from the device cache "
                        "move to (pinned on CUDA), restored on a later prefix match instead of recomputed; "
                        "0: no host tier")
    g.add_argument("--kv-disk-dir", default=None, metavar="D",
                   help="disk KV tier: a directory for evicted and finished K/V (one safetensors file per CP "
                        "shard, keyed by model checksum, dtype, layer layout and token path); the index is "
                        "rebuilt from it at start, so conversations keep their cache across restarts")
    g.add_argument("--kv-disk-gib", type=_gib, default=None, metavar="G",
                   help="bound of the disk KV tier in GiB, least recently used entries deleted beyond it "
                        "(default: half the disk's free space at start)")
    g.add_argument("--state-snapshot-interval", type=_non_negative_int, default=None, metavar="N",
                   help="hybrid (linear-attention) models (qwen3_next, qwen3_5, qwen3_5_moe, kimi_linear, "
                        "nemotron_h): keep a recurrent-state snapshot every N tokens of a prompt, so that requests "
                        "sharing a long document continue from inside it (a prefix match is usable only up to its "
                        "last snapshot); default 0: "
                        "snapshots at the end of each request only. Hybrids run at any CP size with TP 1; KV "
                        "tiers, speculative decoding, FP8 KV, P/D groups and CUDA graphs are refused or off for "
                        "them")


def _scheduler_arguments(parser) -> None:
    g = parser.add_argument_group("scheduler", "lengths and batching")
    g.add_argument("--max-model-len", type=positive_int, default=None, metavar="L",
                   help="longest prompt + completion in tokens (default: the model's context length)")
    g.add_argument("--max-num-batched-tokens", type=positive_int, default=None, metavar="B",
                   help="tokens per forward at most (default: %d, vLLM's for its server): longer prompts are "
                        "prefilled in chunks (partial prefills) and a burst of long prompts gets its first tokens "
                        "one prompt after another" % DEFAULT_MAX_NUM_BATCHED_TOKENS)
    g.add_argument("--max-num-seqs", type=positive_int, default=None,
                   help="running requests at most (default: 64)")


def _observability_arguments(parser) -> None:
    g = parser.add_argument_group("observability", "logs and metrics")
    g.add_argument("--log-level", choices=["critical", "error", "warning", "info", "debug"], default="info",
                   help="uvicorn log level")
    g.add_argument("--access-log", action="store_true", help="log every HTTP request")
    g.add_argument("--enable-log-requests", action="store_true",
                   help="log one line per finished request: id, prompt and output tokens, cached tokens, finish "
                        "reason, TTFT and duration (never the text)")
    g.add_argument("--disable-log-stats", action="store_true", help="no periodic stats log line")
    g.add_argument("--stats-interval", type=_seconds, default=10.0, metavar="S",
                   help="seconds between two throughput / queue / KV-usage log lines while there is traffic "
                        "(0: none)")
