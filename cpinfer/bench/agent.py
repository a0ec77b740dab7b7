"""Agent-shaped conversations (`cpinfer bench agent`): one growing conversation per API, replayed turn after turn
against `cpinfer serve` with prefix caching on and off, at each CP size; per-turn TTFT and cached prompt tokens.

Each turn appends 1-3K tokens of "tool output" (seeded pseudo-text: file paths, line numbers, words) and asks for
about 100 tokens, as a coding agent's loop does. The chat API and the Anthropic Messages API re-send the whole
history every turn; the Responses API sends only the new item with `previous_response_id` (the server keeps the
conversation). With the persistent sharded KV (paper §3.3) turn N prefills only its new tokens, so its TTFT stays
roughly flat in N; without prefix caching every turn re-prefills the whole history and TTFT grows with N.

TTFT is timed on the client, from sending the request to the first streamed event that carries generated output
(a text / reasoning / tool-call delta, or the end of an empty reply). Cached tokens are what the server reports:
`prompt_tokens_details.cached_tokens`, `cache_read_input_tokens`, `input_tokens_details.cached_tokens`.

How flat turn N's TTFT can be depends on the model's width. Turn N's new tokens attend to the whole history H: per
new token ~4·layers·heads·head_dim·H FLOPs of attention against ~2·params of linears, a ratio of about
H / (8·hidden) for a Llama-shaped model. Per layer, an 8K history costs ~2.7x the linears on the embedded SmolLM2-135M
(hidden 576), so TTFT still grows with N even with the KV reused; at Llama-3-8B's width (hidden 4096) it costs
~0.3x. `--random-layers N` serves a random N-layer checkpoint of that width (built once, cached) with the embedded
model's tokenizer and chat template, so that the same text workload runs on a model whose per-turn TTFT is dominated
by its new tokens.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import shutil
import sys
import time
from pathlib import Path

from cpinfer.bench import common as C

APIS = {"chat": "/v1/chat/completions", "messages": "/v1/messages", "responses": "/v1/responses"}
TOOLS = ("read_file", "grep", "run_tests", "list_dir", "git_diff")
WORDS = ("def return self value index error test passed failed assert import config cache token rank shard ring "
         "query key prefill decode block tree node request response stream usage none true false").split()


def _token_range(text: str) -> tuple[int, int]:
    """argparse type of --tokens-per-turn: N or LO-HI (positive integers, LO <= HI)."""
    lo, sep, hi = text.partition("-")
    try:
        bounds = (int(lo), int(hi) if sep else int(lo))
    except ValueError:
        bounds = (0, 0)
    if bounds[0] < 1 or bounds[1] < bounds[0]:
        raise argparse.ArgumentTypeError(f"expected N or LO-HI positive token counts with LO <= HI, got {text!r}")
    return bounds


def _apis(text: str) -> list[str]:
    names = [x.strip() for x in text.split(",") if x.strip()]
    bad = [x for x in names if x not in APIS]
    if not names or bad:
        raise argparse.ArgumentTypeError(f"--apis: comma-separated names from {', '.join(APIS)}; got {text!r}")
    return list(dict.fromkeys(names))


# ---------------------------------------------------------------------------------------------- the workload
def tool_output(tokenizer, tokens: int, rng: random.Random) -> str:
    """Pseudo tool output of exactly `tokens` tokens when encoded alone (lines of paths, numbers, words)."""
    lines: list[str] = []
    while True:
        for _ in range(16):
            path = f"src/{rng.choice(WORDS)}_{rng.randrange(100)}.py:{rng.randrange(1, 2000)}"
            lines.append(path + ": " + " ".join(rng.choice(WORDS) for _ in range(rng.randrange(4, 12))))
        ids = tokenizer.encode("\n".join(lines), add_special_tokens=False)
        if len(ids) >= tokens:
            return tokenizer.decode(ids[:tokens])


def workload(tokenizer, turns: int, bounds: tuple[int, int], seed: int) -> list[str]:
    """The user message of each turn: which tool ran, its output (a seeded size in `bounds`), a request to go on."""
    rng = random.Random(seed)
    texts = []
    for k in range(turns):
        tool = rng.choice(TOOLS)
        body = tool_output(tokenizer, rng.randint(*bounds), rng)
        texts.append(f"Tool {tool} (call {k + 1}) returned:\n{body}\n\nWhat is the next step?")
    return texts


class _Chat:
    """/v1/chat/completions: the whole history every turn."""

    def __init__(self, model: str, system: str, max_tokens: int):
        self.model, self.max_tokens = model, max_tokens
        self.messages = [{"role": "system", "content": system}]

    def body(self, text: str) -> dict:
        self.messages.append({"role": "user", "content": text})
        return {"model": self.model, "messages": list(self.messages), "max_tokens": self.max_tokens,
                "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}

    def after(self, got: dict) -> None:
        self.messages.append({"role": "assistant", "content": got["text"]})

    @staticmethod
    def read(event: dict, got: dict) -> bool:
        if "error" in event:
            raise RuntimeError(f"chat stream error: {event['error'].get('message')}")
        if event.get("usage"):
            usage = event["usage"]
            got["prompt_tokens"] = usage["prompt_tokens"]
            got["cached_tokens"] = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        output = False
        for choice in event.get("choices", []):
            delta = choice.get("delta") or {}
            got["text"] += delta.get("content") or ""
            output |= bool(delta.get("content") or delta.get("reasoning_content") or delta.get("tool_calls")
                           or choice.get("finish_reason"))
        return output


class _Messages(_Chat):
    """/v1/messages (Anthropic): the whole history every turn, the system prompt beside it."""

    def __init__(self, model: str, system: str, max_tokens: int):
        self.model, self.max_tokens, self.system, self.messages = model, max_tokens, system, []

    def body(self, text: str) -> dict:
        self.messages.append({"role": "user", "content": text})
        return {"model": self.model, "system": self.system, "messages": list(self.messages),
                "max_tokens": self.max_tokens, "temperature": 0, "stream": True}

    @staticmethod
    def read(event: dict, got: dict) -> bool:
        kind = event.get("type")
        if kind == "error":
            raise RuntimeError(f"messages stream error: {event.get('error', {}).get('message')}")
        if kind == "content_block_delta":
            got["text"] += event["delta"].get("text") or ""
            return True
        if kind == "message_delta":
            usage = event["usage"]
            got["cached_tokens"] = usage["cache_read_input_tokens"]
            got["prompt_tokens"] = usage["input_tokens"] + usage["cache_read_input_tokens"]
            return True
        return False


class _Responses:
    """/v1/responses (OpenAI): only the new input item each turn, on `previous_response_id` (stored on the server);
    `instructions` are sent every turn (they are not carried over)."""

    def __init__(self, model: str, system: str, max_tokens: int):
        self.model, self.system, self.max_tokens, self.previous = model, system, max_tokens, None

    def body(self, text: str) -> dict:
        body = {"model": self.model, "instructions": self.system, "max_output_tokens": self.max_tokens,
                "input": [{"type": "message", "role": "user", "content": text}], "temperature": 0,
                "store": True, "stream": True}
        if self.previous:
            body["previous_response_id"] = self.previous
        return body

    def after(self, got: dict) -> None:
        self.previous = got["id"]

    @staticmethod
    def read(event: dict, got: dict) -> bool:
        kind = event.get("type", "")
        if kind in ("error", "response.failed"):
            raise RuntimeError(f"responses stream error: {json.dumps(event)[:500]}")
        if kind == "response.output_text.delta":
            got["text"] += event["delta"]
        if kind.endswith(".delta"):
            return True
        if kind in ("response.completed", "response.incomplete"):
            response = event["response"]
            got["id"] = response["id"]
            got["prompt_tokens"] = response["usage"]["input_tokens"]
            got["cached_tokens"] = response["usage"]["input_tokens_details"]["cached_tokens"]
            return True
        return False


CONVERSATIONS = {"chat": _Chat, "messages": _Messages, "responses": _Responses}


def turn(client, api: str, conversation, text: str) -> dict:
    """One streamed turn: TTFT (client-side), prompt and cached tokens as the server reports them."""
    got = {"text": "", "prompt_tokens": None, "cached_tokens": None, "id": None}
    t0 = time.perf_counter()
    first = None
    with client.stream("POST", APIS[api], json=conversation.body(text)) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{APIS[api]} answered {r.status_code}: {r.read().decode(errors='replace')[:500]}")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            if conversation.read(json.loads(line[6:]), got) and first is None:
                first = time.perf_counter()
    if first is None or got["cached_tokens"] is None:
        raise RuntimeError(f"{APIS[api]}: the stream ended without output or usage")
    conversation.after(got)
    return {"ttft_s": first - t0, "prompt_tokens": got["prompt_tokens"], "cached_tokens": got["cached_tokens"]}


def conversation_run(url: str, model: str, api: str, texts: list[str], output_tokens: int, seed: int) -> list[dict]:
    """Every turn of one conversation through `api`, back to back."""
    import httpx

    system = (f"Session {api}-{seed}. You are a coding agent: read each tool's output and say what to do next "
              "in a few sentences.")
    conversation = CONVERSATIONS[api](model, system, output_tokens)
    rows = []
    with httpx.Client(base_url=url, timeout=httpx.Timeout(3600.0)) as client:
        for k, text in enumerate(texts):
            rows.append({"turn": k + 1, **turn(client, api, conversation, text)})
    return rows


# ---------------------------------------------------------------------------------------------- the wide model
# Llama-3-8B's layer width (its head_dim is hidden / heads = 128); --hidden / --heads / --kv-heads / --ffn override it.
WIDTH = {"hidden": 4096, "heads": 32, "kv_heads": 8, "ffn": 14336}
WIDTH_FLAGS = {"hidden": "--hidden", "heads": "--heads", "kv_heads": "--kv-heads", "ffn": "--ffn"}
RANDOM_MAX_POSITIONS = 131072  # Llama-3.1's context: room for long conversations; the engine sizes the KV itself
WEIGHTS_SEED = 0  # the random weights (not --seed, which seeds the workload: one checkpoint serves every seed)


def resolve_width(args) -> dict[str, int]:
    """The random model's width: Llama-3-8B's, with the flags given."""
    return {k: getattr(args, k) if getattr(args, k) is not None else v for k, v in WIDTH.items()}


def check_arguments(args) -> None:
    """Bad combinations of the model flags: ValueError naming the flag, before anything is built or started."""
    width_given = [flag for k, flag in WIDTH_FLAGS.items() if getattr(args, k) is not None]
    if args.random_layers is None:
        given = width_given + (["--random-dir"] if args.random_dir is not None else [])
        if given:
            raise ValueError(f"{', '.join(given)}: only with --random-layers N (they describe its random model); "
                             "add --random-layers, or drop them to serve --model / the embedded model")
        return
    if args.model is not None:
        raise ValueError("--random-layers and --model are mutually exclusive: --random-layers serves a random "
                         "checkpoint it builds, --model an existing one; give one of them")
    w = resolve_width(args)
    for k, flag in WIDTH_FLAGS.items():
        if w[k] < 1:
            raise ValueError(f"{flag} must be a positive integer, got {w[k]}")
    if w["hidden"] % w["heads"] or (w["hidden"] // w["heads"]) % 2:
        raise ValueError(f"--heads ({w['heads']}) must divide --hidden ({w['hidden']}) into heads of an even size "
                         "(rotary embeddings rotate pairs of dimensions)")
    if w["heads"] % w["kv_heads"]:
        raise ValueError(f"--kv-heads ({w['kv_heads']}) must divide --heads ({w['heads']})")


def random_config(layers: int, hidden: int, heads: int, kv_heads: int, ffn: int) -> dict:
    """config.json of the random model: Llama-3's layer (rope theta 500000, GQA) at the given width, tied
    embeddings (half the embedding memory), the embedded model's vocabulary and special token ids."""
    from cpinfer.model.random_checkpoint import random_config_dict
    from cpinfer.model.resolve import resolve_model

    embedded = json.loads((resolve_model(None) / "config.json").read_text())
    return random_config_dict(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                              num_key_value_heads=kv_heads, intermediate_size=ffn, rope_theta=500000.0,
                              tie_word_embeddings=True, max_position_embeddings=RANDOM_MAX_POSITIONS,
                              **{k: embedded[k] for k in ("vocab_size", "rms_norm_eps", "bos_token_id",
                                                          "eos_token_id", "pad_token_id") if k in embedded})


def shape_text(cfg: dict) -> str:
    """The random model's shape for the report's heading (its checkpoint folder is no name to show)."""
    from cpinfer.model.resolve import DEFAULT_MODEL_NAME

    return (f"hidden {cfg['hidden_size']}, {cfg['num_hidden_layers']} layers, {cfg['num_attention_heads']} heads x "
            f"{cfg['head_dim']}, {cfg['num_key_value_heads']} KV heads, ffn {cfg['intermediate_size']}, vocab "
            f"{cfg['vocab_size']}, tied embeddings, rope theta {cfg['rope_theta']:g}; random weights, "
            f"{DEFAULT_MODEL_NAME}'s tokenizer")


def random_model_title(layers: int, width: dict) -> str:
    return f"a random {layers}-layer model of " + ("Llama-3-8B's width" if width == WIDTH else "a chosen width")


def build_random_model(layers: int, *, hidden: int, heads: int, kv_heads: int, ffn: int, seed: int = 0,
                       root: Path | None = None) -> Path:
    """The random checkpoint (float32 safetensors, seeded) with the embedded model's tokenizer and chat template
    beside it, in `root` (default: the cpinfer cache) / bench-agent-<hash of shape, seed and tokenizer>; written
    once (into a temp folder renamed into place) and reused afterwards. Prints one line saying which."""
    from transformers import AutoTokenizer

    from cpinfer.model.random_checkpoint import write_random_checkpoint
    from cpinfer.model.resolve import resolve_model

    embedded = resolve_model(None)
    cfg = random_config(layers, hidden, heads, kv_heads, ffn)
    key = hashlib.sha1(json.dumps([seed, cfg, embedded.name], sort_keys=True).encode()).hexdigest()[:10]
    root = Path(root).expanduser() if root is not None else C.cache_dir()
    path = root / f"bench-agent-{key}"
    what = f"random {layers}-layer checkpoint ({shape_text(cfg)}; seed {seed})"
    if (path / "config.json").is_file():
        print(f"bench agent: using the cached {what} in {path}", file=sys.stderr, flush=True)
        return path
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    write_random_checkpoint(tmp, seed=seed, **cfg)
    AutoTokenizer.from_pretrained(str(embedded)).save_pretrained(str(tmp))
    if (embedded / "generation_config.json").is_file():
        shutil.copy(embedded / "generation_config.json", tmp / "generation_config.json")
    try:
        os.rename(tmp, path)  # atomic: config.json in `path` means the whole checkpoint is there
    except OSError:  # a concurrent builder got there first
        shutil.rmtree(tmp, ignore_errors=True)
    size = sum(f.stat().st_size for f in path.iterdir()) / 2**30
    print(f"bench agent: built a {what}, {size:.2f} GiB, in {path}", file=sys.stderr, flush=True)
    return path


# ---------------------------------------------------------------------------------------------- measure
def measure(args) -> dict:
    from transformers import AutoTokenizer

    from cpinfer.bench.serve import Config, _Server
    from cpinfer.model.resolve import DEFAULT_MODEL_NAME, resolve_model

    check_arguments(args)
    shape = None
    if args.random_layers is not None:
        width = resolve_width(args)
        model_dir = build_random_model(args.random_layers, **width, seed=WEIGHTS_SEED, root=args.random_dir)
        name = f"random-{args.random_layers}L-h{width['hidden']}"
        shape = shape_text(json.loads((model_dir / "config.json").read_text()))
    else:
        model_dir = resolve_model(args.model)
        name = Path(args.model).name if args.model else DEFAULT_MODEL_NAME
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    # one conversation per API (distinct seeds: no API reads another's prefix), the same under every configuration
    texts = {api: workload(tokenizer, args.turns, args.tokens_per_turn, args.seed * 1000 + i)
             for i, api in enumerate(args.apis)}
    warm = workload(tokenizer, 1, (args.tokens_per_turn[0],) * 2, -1)
    extra = ("--max-kv-tokens-per-rank", str(args.max_kv_tokens_per_rank)) if args.max_kv_tokens_per_rank else ()
    runs = []
    for cp in args.cp:
        for caching in (True, False):
            config = Config(cp, caching)
            print(f"[{config.label}] starting the server ...", file=sys.stderr, flush=True)
            server = _Server(model_dir, name, config, args, extra)
            try:
                server.wait_ready()
                # an unrelated turn as long as the shortest first: start-up costs stay out of turn 1
                conversation_run(server.url, name, "chat", warm, 2, -1)
                for api in args.apis:
                    print(f"[{config.label}] {api}: {args.turns} turns ...", file=sys.stderr, flush=True)
                    rows = conversation_run(server.url, name, api, texts[api], args.output_tokens,
                                            args.seed * 1000 + args.apis.index(api))
                    runs.append({"cp": cp, "api": api, "prefix_caching": caching, "turns": rows})
            finally:
                server.stop()
    res = {"bench": "agent", "command": command_line(args), "model": name, "cp": args.cp, "apis": args.apis,
           "turns": args.turns, "tokens_per_turn": list(args.tokens_per_turn), "output_tokens": args.output_tokens,
           "runs": runs, "hardware": C.hardware_text(C.hardware(args))}
    if shape is not None:
        res["model"] = random_model_title(args.random_layers, resolve_width(args))
        res["shape"] = shape
    if args.plot:
        plot(res, args.plot)
        res["plot"] = str(args.plot)
    return res


def _run(res: dict, cp: int, api: str, caching: bool) -> dict | None:
    return next((r for r in res["runs"] if (r["cp"], r["api"], r["prefix_caching"]) == (cp, api, caching)), None)


# ---------------------------------------------------------------------------------------------- report
def turn_rows(on: dict, off: dict) -> list[list[str]]:
    """One table row per turn: prompt and cached tokens and TTFT with prefix caching on and off, off / on, and each
    turn's TTFT over turn 1's with caching on and off (flat in N: ~1; re-prefilling the history: grows ~N-fold)."""
    rows = []
    for a, b in zip(on["turns"], off["turns"]):
        rows.append([str(a["turn"]), str(a["prompt_tokens"]), str(a["cached_tokens"]), f"{1000 * a['ttft_s']:.0f}",
                     str(b["cached_tokens"]), f"{1000 * b['ttft_s']:.0f}", f"{b['ttft_s'] / a['ttft_s']:.2f}",
                     f"{a['ttft_s'] / on['turns'][0]['ttft_s']:.2f}", f"{b['ttft_s'] / off['turns'][0]['ttft_s']:.2f}"])
    return rows


TABLE_HEADER = ["turn", "prompt tokens", "cached (on)", "TTFT on ms", "cached (off)", "TTFT off ms", "off / on",
                "on: turn N / turn 1", "off: turn N / turn 1"]


def format_report(res: dict) -> str:
    lo, hi = res["tokens_per_turn"]
    model = f"{res['model']} ({res['shape']})" if res.get("shape") else res["model"]
    lines = [f"Agent conversations, {model}, {res['hardware']}: {res['turns']} turns, each adding {lo}-{hi} "
             f"tokens of tool output and asking for {res['output_tokens']} tokens; TTFT (client-side) and cached "
             "prompt tokens per turn, prefix caching on vs off."]
    for cp in res["cp"]:
        for api in res["apis"]:
            on, off = _run(res, cp, api, True), _run(res, cp, api, False)
            growth = [r["turns"][-1]["ttft_s"] / r["turns"][0]["ttft_s"] for r in (on, off)]
            lines += ["", f"CP{cp}, {APIS[api]} ({api}):", C.fmt_table(TABLE_HEADER, turn_rows(on, off)),
                      f"last turn's TTFT / first turn's: caching on {growth[0]:.2f}, off {growth[1]:.2f}"]
    if res.get("plot"):
        lines += ["", f"plot: {res['plot']}"]
    return "\n".join(lines)


def plot(res: dict, path: Path) -> None:
    """TTFT by turn: one panel per API, one line per CP size and caching on / off."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(res["apis"]), figsize=(4.2 * len(res["apis"]), 3.8), squeeze=False)
    for ax, api in zip(axes[0], res["apis"]):
        for i, cp in enumerate(res["cp"]):
            for caching in (True, False):
                rows = _run(res, cp, api, caching)["turns"]
                ax.plot([r["turn"] for r in rows], [r["ttft_s"] for r in rows], marker="o", color=f"C{i}",
                        linestyle="-" if caching else "--",
                        label=f"CP{cp}, prefix caching {'on' if caching else 'off'}")
        ax.set_title(APIS[api])
        ax.set_xlabel("turn")
        ax.set_ylabel("TTFT (s)")
        ax.set_xticks(range(1, res["turns"] + 1))
        ax.grid(True, alpha=0.3)
    axes[0][0].legend(fontsize=8)
    lo, hi = res["tokens_per_turn"]
    fig.suptitle(f"{res['model']}: +{lo}-{hi} tool-output tokens per turn, {res['output_tokens']} output tokens")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def command_line(args) -> str:
    lo, hi = args.tokens_per_turn
    parts = [f"cpinfer bench agent --cp {','.join(map(str, args.cp))} --turns {args.turns}",
             f"--tokens-per-turn {lo}-{hi} --output-tokens {args.output_tokens} --apis {','.join(args.apis)}",
             f"--seed {args.seed} --threads-per-rank {args.threads_per_rank}"]
    if args.random_layers is not None:
        parts.append(f"--random-layers {args.random_layers}")
        parts += [f"{WIDTH_FLAGS[k]} {v}" for k, v in resolve_width(args).items() if v != WIDTH[k]]
    for flag, value in (("--model", args.model), ("--random-dir", args.random_dir),
                        ("--max-model-len", args.max_model_len),
                        ("--max-num-batched-tokens", args.max_num_batched_tokens),
                        ("--max-kv-tokens-per-rank", args.max_kv_tokens_per_rank), ("--plot", args.plot)):
        if value:
            parts.append(f"{flag} {value}")
    return " ".join(parts) + C.hardware_flags(C.hardware(args))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--cp", type=C.cp_sizes, default=[1, 2], help="CP sizes, comma-separated (default: 1,2)")
    parser.add_argument("--turns", type=C.positive_int, default=6, help="turns per conversation (default: 6)")
    parser.add_argument("--tokens-per-turn", type=_token_range, default=(1000, 3000), metavar="LO-HI",
                        help="tool-output tokens each turn adds, drawn from LO-HI by the seed (default: 1000-3000)")
    parser.add_argument("--output-tokens", type=C.positive_int, default=100,
                        help="max tokens asked for each turn (default: 100)")
    parser.add_argument("--apis", type=_apis, default=list(APIS),
                        help=f"APIs to replay the conversation through (default: {','.join(APIS)})")
    parser.add_argument("--plot", type=Path, default=None, metavar="PNG", help="write TTFT by turn as a PNG")
    parser.add_argument("--seed", type=int, default=0, help="seed of the tool outputs (default: 0)")
    parser.add_argument("--model", default=None, metavar="PATH",
                        help="checkpoint folder or .gguf (default: the embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--random-layers", type=C.positive_int, nargs="?", const=2, default=None, metavar="N",
                        help="instead of --model, serve a random N-layer checkpoint (N default: 2) of Llama-3-8B's "
                             "layer width with the embedded model's tokenizer and chat template, built once and "
                             "cached. The embedded SmolLM2-135M is so narrow (hidden 576) that attention over an 8K "
                             "history outweighs its linears and turn N's TTFT grows with N even with the KV reused; "
                             "at hidden 4096 the new tokens' linears dominate and TTFT stays about flat with prefix "
                             "caching on (~3 GB per rank)")
    for key, flag in WIDTH_FLAGS.items():
        parser.add_argument(flag, type=C.positive_int, default=None,
                            help=f"with --random-layers: {key.replace('_', ' ')} (default: {WIDTH[key]})"
                                 + (", a divisor of --hidden into even head sizes" if key == "heads" else
                                    ", a divisor of --heads" if key == "kv_heads" else ""))
    parser.add_argument("--random-dir", type=Path, default=None, metavar="DIR",
                        help="with --random-layers: the folder the random checkpoints are cached in, one "
                             "bench-agent-<hash> folder per shape and seed (default: $CPINFER_CACHE or "
                             "~/.cache/cpinfer)")
    parser.add_argument("--threads-per-rank", type=C.positive_int, default=1, help="torch threads per rank")
    parser.add_argument("--max-model-len", type=C.positive_int, default=None, help="passed to cpinfer serve")
    parser.add_argument("--max-num-batched-tokens", type=C.positive_int, default=None,
                        help="passed to cpinfer serve")
    parser.add_argument("--max-kv-tokens-per-rank", type=C.positive_int, default=None,
                        help="passed to cpinfer serve")
    C.add_common_arguments(parser)


def run(args) -> int:
    check_arguments(args)  # bad flags: one clear error before any checkpoint is built or server started
    # the random model's section is its own, beside the embedded model's
    doc_key = "agent" if args.random_layers is None else "agent-random"
    return C.run_measured(args, measure, format_report, doc_key,
                          lambda res: f"Agent conversations, {res['model']}: TTFT and cached tokens per turn, "
                                      "prefix caching on vs off")
