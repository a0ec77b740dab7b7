"""Serving: multi-turn long-document chats against `cpinfer serve` (CP1 vs CP2, and CP2 without prefix caching).

Each session opens with a distinct document and asks questions turn after turn; sessions arrive as a Poisson
process. With persistent KV (paper §3.3) turn k+1 prefills only the new tokens; without prefix caching every turn
re-prefills its whole history. Reports request throughput, output tokens/s, TTFT and inter-token latency p50 / p99
(overall and per turn), the prefix-cache hit rate, the server overhead of a 16-token completion against `LLM`
offline, and a PNG of TTFT per turn.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from cpinfer.bench.common import (ForeignCPU, add_common_arguments, finish_report, fmt_table, hardware, measured,
                                  positive_int)

WORDS = ("ring attention shards keys values across ranks while queries rotate the cache persists between turns "
         "so the second question reuses every token of the document instead of computing it again long context "
         "inference needs memory bandwidth compute and careful scheduling of prefill and decode").split()
QUESTIONS = ["Summarise the document in one sentence.", "Which part of it matters most, and why?",
             "What would you ask its author?", "Give it a title.", "List three keywords.", "What is missing?"]


@dataclasses.dataclass(frozen=True)
class Config:
    """One server configuration: CP size and whether prefix caching (persistent KV reuse) is on."""

    cp: int
    prefix_caching: bool = True

    @classmethod
    def parse(cls, text: str) -> "Config":
        name = text.strip().lower()
        base, _, suffix = name.partition("-")
        if not base.startswith("cp") or not base[2:].isdigit() or int(base[2:]) < 1 or suffix not in ("", "nocache"):
            raise ValueError(f"configuration {text!r}: expected cpN or cpN-nocache (e.g. cp1,cp2,cp2-nocache)")
        return cls(int(base[2:]), suffix != "nocache")

    @property
    def label(self) -> str:
        return f"CP{self.cp}" + ("" if self.prefix_caching else " no-prefix-cache")

    def serve_args(self) -> list[str]:
        return ["--cp", str(self.cp)] + ([] if self.prefix_caching else ["--no-prefix-caching"])


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    k = (len(s) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def make_documents(tokenizer, sessions: int, doc_tokens: int, seed: int) -> list[str]:
    """`sessions` distinct pseudo-texts of about `doc_tokens` tokens each (counted with the model's tokenizer)."""
    docs = []
    for s in range(sessions):
        rng = random.Random(seed * 1000 + s)
        words = [f"Document {s}."]
        while True:
            words.extend(rng.choice(WORDS) for _ in range(64))
            text = " ".join(words)
            if len(tokenizer.encode(text)) >= doc_tokens:
                break
        ids = tokenizer.encode(text)[:doc_tokens]
        docs.append(tokenizer.decode(ids))
    return docs


async def _chat_turn(client, url: str, model: str, messages: list[dict], max_tokens: int) -> dict:
    """One streamed chat turn: TTFT, the gaps between content chunks, the answer and usage, timed on the client."""
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    first = last = None
    gaps, text, usage = [], "", None
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"server answered {r.status_code}: {(await r.aread()).decode()[:500]}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise RuntimeError(f"server error: {event['error']['message']}")
            if event.get("usage"):
                usage = event["usage"]
            for choice in event.get("choices", []):
                if choice["delta"].get("content") or choice.get("finish_reason"):
                    now = time.perf_counter()
                    if first is None:
                        first = now
                    else:
                        gaps.append(now - last)
                    last = now
                    text += choice["delta"].get("content") or ""
    return {"ttft_s": first - t0, "itl_s": gaps, "e2e_s": time.perf_counter() - t0, "text": text,
            "prompt_tokens": usage["prompt_tokens"], "completion_tokens": usage["completion_tokens"],
            "cached_tokens": usage["prompt_tokens_details"]["cached_tokens"]}


async def run_workload(url: str, model: str, docs: list[str], turns: int, max_tokens: int, rate: float,
                       seed: int, headers: dict | None = None) -> dict:
    """Sessions start at Poisson arrival times (`rate` per second); each runs its turns back to back."""
    import httpx

    rng = random.Random(seed)
    starts, t = [], 0.0
    for _ in docs:
        starts.append(t)
        t += rng.expovariate(rate)
    results: list[dict] = []

    async def session(i: int, client) -> None:
        await asyncio.sleep(starts[i])
        messages = [{"role": "system", "content": "You answer questions about the document the user gives."}]
        for k in range(turns):
            question = QUESTIONS[k % len(QUESTIONS)]
            content = f"{docs[i]}\n\n{question}" if k == 0 else question
            messages.append({"role": "user", "content": content})
            res = await _chat_turn(client, url, model, messages, max_tokens)
            res.update(session=i, turn=k + 1)
            results.append(res)
            messages.append({"role": "assistant", "content": res.pop("text")})

    t0 = time.perf_counter()
    async with httpx.AsyncClient(timeout=httpx.Timeout(1800.0), headers=headers or {}) as client:
        await asyncio.gather(*(session(i, client) for i in range(len(docs))))
    return {"wall_s": time.perf_counter() - t0, "requests": sorted(results, key=lambda r: (r["session"], r["turn"]))}


def summarise(run: dict, turns: int) -> dict:
    reqs = run["requests"]
    ttft = [r["ttft_s"] for r in reqs]
    itl = [g for r in reqs for g in r["itl_s"]]
    prompt = sum(r["prompt_tokens"] for r in reqs)
    later = [r["ttft_s"] for r in reqs if r["turn"] >= 2]
    return {
        "requests": len(reqs), "wall_s": run["wall_s"], "req_per_s": len(reqs) / run["wall_s"],
        "output_tok_per_s": sum(r["completion_tokens"] for r in reqs) / run["wall_s"],
        "ttft_p50_s": _percentile(ttft, 0.5), "ttft_p99_s": _percentile(ttft, 0.99),
        "ttft_turn2plus_p50_s": _percentile(later, 0.5),
        "itl_p50_s": _percentile(itl, 0.5), "itl_p99_s": _percentile(itl, 0.99),
        "prefix_hit_rate": sum(r["cached_tokens"] for r in reqs) / prompt if prompt else 0.0,
        "ttft_by_turn_p50_s": [_percentile([r["ttft_s"] for r in reqs if r["turn"] == k], 0.5)
                               for k in range(1, turns + 1)],
        "prompt_tokens_by_turn": [statistics.mean(r["prompt_tokens"] for r in reqs if r["turn"] == k)
                                  for k in range(1, turns + 1)],
    }


# ---------------------------------------------------------------------------------------------- servers
class _Server:
    """A `cpinfer serve` subprocess on a free loopback port, stopped with SIGTERM; `extra` flags go last."""

    def __init__(self, model_dir: Path, name: str, config: Config, args, extra: tuple[str, ...] = ()):
        from cpinfer.launch import free_port

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "cpinfer", "serve", "--model", str(model_dir), "--served-model-name", name,
               "--port", str(self.port), "--threads-per-rank", str(args.threads_per_rank), "--log-level", "warning",
               *config.serve_args()]
        if args.max_model_len:
            cmd += ["--max-model-len", str(args.max_model_len)]
        if args.max_num_batched_tokens:
            cmd += ["--max-num-batched-tokens", str(args.max_num_batched_tokens)]
        hw = hardware(args)
        cmd += ["--device", hw["device"], "--dtype", hw["dtype"], "--attention-backend", hw["attention_backend"],
                "--gpu-memory-utilization", str(hw["gpu_memory_utilization"])] + (["--share-gpus"] * hw["share_gpus"])
        cmd += list(extra)
        self.log = tempfile.TemporaryFile("w+")  # a file, not a pipe: a chatty server never blocks on it
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=self.log, text=True)

    def wait_ready(self, timeout: float = 600.0) -> None:
        import httpx

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.log.seek(0)
                raise RuntimeError(f"cpinfer serve exited ({self.proc.returncode}): {self.log.read()[-3000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"cpinfer serve was not ready after {timeout:.0f}s")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


class RemoteTokenizer:
    """encode / decode through a running server's /tokenize and /detokenize (for `--url`)."""

    def __init__(self, url: str, headers: dict):
        import httpx

        self._client = httpx.Client(base_url=url, headers=headers, timeout=120)

    def encode(self, text: str) -> list[int]:
        r = self._client.post("/tokenize", json={"prompt": text, "add_special_tokens": False})
        r.raise_for_status()
        return r.json()["tokens"]

    def decode(self, ids: list[int]) -> str:
        r = self._client.post("/detokenize", json={"tokens": ids})
        r.raise_for_status()
        return r.json()["prompt"]


def _served_model(url: str, headers: dict) -> str:
    import httpx

    r = httpx.get(url + "/v1/models", headers=headers, timeout=60)
    if r.status_code != 200:
        raise ValueError(f"--url {url}: GET /v1/models answered {r.status_code}: {r.text[:300]}")
    return r.json()["data"][0]["id"]


def _overhead_prompt(tokenizer, tokens: int) -> list[int]:
    ids = tokenizer.encode(" ".join(WORDS * (1 + tokens // len(WORDS))))
    return ids[:tokens]


def overhead(url: str, name: str, model_dir: Path, config: Config, args, prompt: list[int],
             max_tokens: int = 16) -> dict:
    """A non-streamed `max_tokens` completion through HTTP vs the same request through `LLM.generate` in this
    process, on the same CP layout, alternated (server, offline, server, ...) after one warm-up each so that
    drifting machine load hits both alike. Both engines serve the repeats from their prefix caches alike."""
    import httpx

    from cpinfer import LLM, SamplingParams

    body = {"model": name, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    kwargs = {"max_model_len": args.max_model_len} if args.max_model_len else {}
    times: dict[str, list[float]] = {"server": [], "offline": []}
    with httpx.Client(timeout=600) as client, \
            LLM(str(model_dir), context_parallel_size=config.cp, threads_per_rank=args.threads_per_rank,
                enable_prefix_caching=config.prefix_caching, **kwargs, **hardware(args)) as llm:
        for i in range(args.overhead_repeat + 1):
            t0 = time.perf_counter()
            r = client.post(url + "/v1/completions", json=body)
            r.raise_for_status()
            t1 = time.perf_counter()
            out = llm.generate([prompt], params, use_tqdm=False)[0]
            t2 = time.perf_counter()
            if r.json()["usage"]["completion_tokens"] != max_tokens or len(out.token_ids) != max_tokens:
                raise RuntimeError("the overhead request did not produce max_tokens tokens")
            if i:  # the first round is the warm-up
                times["server"].append(t1 - t0)
                times["offline"].append(t2 - t1)
    server_s, offline_s = statistics.median(times["server"]), statistics.median(times["offline"])
    return {"server_s": server_s, "offline_s": offline_s, "ratio": server_s / offline_s, "max_tokens": max_tokens,
            "repeat": args.overhead_repeat, "prompt_tokens": len(prompt)}


# ---------------------------------------------------------------------------------------------- report
def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for label, summary in res["configs"].items():
        ys = summary["ttft_by_turn_p50_s"]
        ax.plot(range(1, len(ys) + 1), ys, marker="o", label=label)
    ax.set_yscale("log")
    ax.set_xlabel("turn")
    ax.set_ylabel("TTFT p50 (s, log scale)")
    ax.set_xticks(range(1, res["turns"] + 1))
    ax.set_title(f"{res['sessions']} sessions x {res['turns']} turns, {res['doc_tokens']}-token documents")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _ms(x: float | None) -> str:
    return "n/a" if x is None else f"{1000 * x:.0f}"


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.0f}%"


def format_report(res: dict) -> str:
    rows = [["config", "req/s", "out tok/s", "TTFT p50 ms", "TTFT p99 ms", "turn>=2 TTFT p50 ms", "ITL p50 ms",
             "ITL p99 ms", "prefix hit", "others' CPU"]]
    for label, s in res["configs"].items():
        rows.append([label, f"{s['req_per_s']:.3f}", f"{s['output_tok_per_s']:.1f}", _ms(s["ttft_p50_s"]),
                     _ms(s["ttft_p99_s"]), _ms(s["ttft_turn2plus_p50_s"]), _ms(s["itl_p50_s"]), _ms(s["itl_p99_s"]),
                     f"{100 * s['prefix_hit_rate']:.1f}%", _pct(s.get("foreign_cpu_share"))])
    lines = [fmt_table(rows[0], rows[1:]), "", "TTFT p50 by turn (ms):"]
    for label, s in res["configs"].items():
        lines.append(f"  {label}: " + ", ".join(_ms(x) for x in s["ttft_by_turn_p50_s"])
                     + f"  (prompt tokens by turn: {', '.join(f'{p:.0f}' for p in s['prompt_tokens_by_turn'])})")
    for r in res.get("speedups", []):
        lines.append(f"turn>=2 TTFT p50 {r['baseline']} / {r['config']}: {r['ratio']:.1f}x (target: >= 5x)")
    for label, o in res.get("overhead", {}).items():
        lines.append(f"{label}: {o['max_tokens']}-token completion ({o['prompt_tokens']}-token prompt), median of "
                     f"{o['repeat']} alternated: server "
                     f"{_ms(o['server_s'])} ms, LLM offline {_ms(o['offline_s'])} ms, ratio {o['ratio']:.2f} "
                     "(target: <= 1.2)")
    if res.get("plot"):
        lines.append(f"plot: {res['plot']}")
    return "\n".join(lines)


def _header(args) -> dict:
    key = args.api_key or os.environ.get("CPINFER_API_KEY")
    return {"Authorization": f"Bearer {key}"} if key else {}


def measure_url(args) -> dict:
    """The workload against a server someone else started (`--url`); no configurations, no overhead run."""
    headers = _header(args)
    url = args.url.rstrip("/")
    name = _served_model(url, headers)
    docs = make_documents(RemoteTokenizer(url, headers), args.sessions, args.doc_tokens, args.seed)
    run = asyncio.run(run_workload(url, name, docs, args.turns, args.max_tokens, args.rate, args.seed, headers))
    label = args.label or url
    res = {"model": name, "sessions": args.sessions, "turns": args.turns, "doc_tokens": args.doc_tokens,
           "max_tokens": args.max_tokens, "rate": args.rate, "configs": {label: summarise(run, args.turns)},
           "raw": {label: [{k: v for k, v in r.items() if k != "itl_s"} for r in run["requests"]]},
           "overhead": {}, "speedups": [], "command": _command()}
    if args.plot:
        plot(res, args.plot)
        res["plot"] = str(args.plot)
    return res


def _command() -> str:
    argv = sys.argv[3:] if sys.argv[1:3] == ["bench", "serve"] else sys.argv[1:]
    return "cpinfer bench serve " + " ".join(argv)


def measure(args) -> dict:
    from transformers import AutoTokenizer

    from cpinfer.model.resolve import DEFAULT_MODEL_NAME, resolve_model

    if args.url:
        return measure_url(args)
    configs = [Config.parse(c) for c in args.configs.split(",") if c.strip()]
    model_dir = resolve_model(args.model)
    name = Path(args.model).name if args.model else DEFAULT_MODEL_NAME
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    docs = make_documents(tokenizer, args.sessions, args.doc_tokens, args.seed)
    prompt = _overhead_prompt(tokenizer, args.overhead_prompt_tokens)
    res = {"model": name, "sessions": args.sessions, "turns": args.turns, "doc_tokens": args.doc_tokens,
           "max_tokens": args.max_tokens, "rate": args.rate, "configs": {}, "overhead": {}, "raw": {},
           "command": _command()}
    for config in configs:
        print(f"[{config.label}] starting the server ...", file=sys.stderr, flush=True)
        server = _Server(model_dir, name, config, args)
        try:
            server.wait_ready()
            print(f"[{config.label}] {args.sessions} sessions x {args.turns} turns ...", file=sys.stderr, flush=True)
            with ForeignCPU() as foreign:  # the server is a child of this process: only others' CPU counts
                run = asyncio.run(run_workload(server.url, name, docs, args.turns, args.max_tokens, args.rate,
                                               args.seed))
                server.stop()
            res["configs"][config.label] = summarise(run, args.turns)
            res["configs"][config.label]["foreign_cpu_share"] = foreign.share
            res["raw"][config.label] = [{k: v for k, v in r.items() if k != "itl_s"} for r in run["requests"]]
        finally:
            server.stop()
        if args.overhead_repeat and config.prefix_caching:  # on a fresh server, beside LLM offline
            print(f"[{config.label}] server overhead ...", file=sys.stderr, flush=True)
            server = _Server(model_dir, name, config, args)
            try:
                server.wait_ready()
                res["overhead"][config.label] = overhead(server.url, name, model_dir, config, args, prompt)
            finally:
                server.stop()
    labels = {(c.cp, c.prefix_caching): c.label for c in configs}
    res["speedups"] = []
    for (cp, cached), label in labels.items():
        base = labels.get((cp, False))
        if cached and base is not None:
            ratio = res["configs"][base]["ttft_turn2plus_p50_s"] / res["configs"][label]["ttft_turn2plus_p50_s"]
            res["speedups"].append({"config": label, "baseline": base, "ratio": ratio})
    if args.plot:
        plot(res, args.plot)
        res["plot"] = str(args.plot)
    return res


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, metavar="PATH",
                        help="checkpoint folder or .gguf (default: the embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--configs", default="cp1,cp2,cp2-nocache",
                        help="server configurations to start one after the other, comma-separated: cpN or "
                             "cpN-nocache (no prefix caching)")
    parser.add_argument("--url", default=None, help="run the workload against this running server instead "
                        "(e.g. http://127.0.0.1:8000); --configs and the overhead run are then skipped")
    parser.add_argument("--label", default=None, help="name of the --url server in the report")
    parser.add_argument("--api-key", default=None, help="API key of the --url server (or CPINFER_API_KEY)")
    parser.add_argument("--sessions", type=positive_int, default=8, help="chat sessions, one document each")
    parser.add_argument("--turns", type=positive_int, default=4, help="turns per session")
    parser.add_argument("--doc-tokens", type=positive_int, default=4096, help="tokens per document")
    parser.add_argument("--max-tokens", type=positive_int, default=16, help="tokens per answer")
    parser.add_argument("--rate", type=float, default=1.0, help="session arrivals per second (Poisson)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the documents and arrival times")
    parser.add_argument("--threads-per-rank", type=positive_int, default=1, help="torch threads per rank")
    parser.add_argument("--max-model-len", type=positive_int, default=None, help="passed to cpinfer serve")
    parser.add_argument("--max-num-batched-tokens", type=positive_int, default=None, help="passed to cpinfer serve")
    parser.add_argument("--overhead-repeat", type=int, default=5,
                        help="timed 16-token completions per configuration, server vs LLM offline (0 = skip)")
    parser.add_argument("--overhead-prompt-tokens", type=positive_int, default=128,
                        help="prompt length of the overhead measurement")
    parser.add_argument("--plot", type=Path, default=None, metavar="PNG", help="write TTFT per turn as a PNG")
    add_common_arguments(parser)


def run(args) -> int:
    if args.rate <= 0:
        raise ValueError(f"--rate must be > 0 sessions per second, got {args.rate}")
    hardware(args)  # a device the machine lacks: exit 2 now
    res, machine = measured(measure, args)
    res["machine"] = machine
    finish_report(args, res, format_report(res), "serve", f"Serving, {res['model']}: {res['sessions']} sessions x "
                  f"{res['turns']} turns over {res['doc_tokens']}-token documents")
    return 0
