"""KV tiers below the device cache (`cpinfer bench kv-tiers`), on the embedded model (SmolLM2-135M-Instruct).

Chat sessions over distinct long documents on a device cache holding about two of them: turn >= 2 TTFT with a host
tier vs without tiers, and the prefix hit rate; a conversation over an 8K-token document continued after a restart
from the disk tier vs a cold prefill of the same history; restore throughput per tier beside a memory-copy rate
measured in the same run.
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

from cpinfer.bench import common as C

_GIB = float(1 << 30)


def _llm(cp: int, capacity: int, hw: dict, **tiers):
    from cpinfer import LLM

    return LLM(None, context_parallel_size=cp, threads_per_rank=max(1, (os.cpu_count() or 1) // cp),
               max_kv_tokens_per_rank=capacity, placement="shard", **hw, **tiers)


def _params(n: int):
    from cpinfer import SamplingParams

    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def sessions(args, hw: dict, vocab: int, **tiers) -> dict:
    """`args.sessions` chats, turn by turn (every session's turn 1, then every turn 2, ...): TTFT per turn."""
    per_session = args.doc + args.turns * (args.question + args.answer)
    capacity = C.kv_capacity(-(-args.device_sessions * per_session // args.cp))
    docs = [C.random_prompt(args.doc, vocab, seed=1000 + i) for i in range(args.sessions)]
    history = [list(d) for d in docs]
    ttft: dict[int, list[float]] = {}
    with _llm(args.cp, capacity, hw, **tiers) as llm:
        llm.generate(C.random_prompt(256, vocab, seed=7), _params(2), use_tqdm=False)  # warm-up
        for turn in range(1, args.turns + 1):
            for i in range(args.sessions):
                prompt = history[i] + C.random_prompt(args.question, vocab, seed=10_000 * turn + i)
                out = llm.generate(prompt, _params(args.answer), use_tqdm=False)[0]
                ttft.setdefault(turn, []).append(out.metrics["ttft_s"])
                history[i] = prompt + out.token_ids
            if turn == 1:
                after1 = llm.cache_stats()
        stats = llm.cache_stats()
    later = [t for turn, ts in ttft.items() if turn >= 2 for t in ts]
    queries = stats["prefix_cache_queries"] - after1["prefix_cache_queries"]
    hits = stats["prefix_cache_hits"] - after1["prefix_cache_hits"]
    tiers_out = {k: {f: v.get(f) for f in ("hit_tokens", "restored_bytes", "restore_s")}
                 for k, v in stats["tiers"].items()}
    return {"capacity_per_rank": capacity, "ttft_turn1_p50_s": statistics.median(ttft[1]),
            "ttft_later_p50_s": statistics.median(later), "ttft_s": ttft, "hit_rate_later": hits / max(queries, 1),
            "tiers": tiers_out}


def restart(args, hw: dict, vocab: int) -> dict:
    """Turn 1 over a long document with a disk tier; restart; turn 2 (timed); a cold prefill of turn 2's prompt."""
    doc = C.random_prompt(args.restart_doc, vocab, seed=77)
    capacity = C.kv_capacity(-(-(args.restart_doc + 4 * (args.question + args.answer)) // args.cp))
    with tempfile.TemporaryDirectory(prefix="cpinfer-kv-bench-") as d:
        with _llm(args.cp, capacity, hw, kv_disk_dir=d) as llm:
            prompt1 = doc + C.random_prompt(args.question, vocab, seed=1)
            out1 = llm.generate(prompt1, _params(args.answer), use_tqdm=False)[0]
        written = sum(os.path.getsize(os.path.join(d, f)) for f in os.listdir(d) if f.endswith(".safetensors"))
        prompt2 = prompt1 + out1.token_ids + C.random_prompt(args.question, vocab, seed=2)
        t0 = time.perf_counter()
        with _llm(args.cp, capacity, hw, kv_disk_dir=d) as llm:
            start_s = time.perf_counter() - t0
            out2 = llm.generate(prompt2, _params(args.answer), use_tqdm=False)[0]
            disk = llm.cache_stats()["tiers"]["disk"]
    with _llm(args.cp, capacity, hw) as llm:
        cold = llm.generate(prompt2, _params(args.answer), use_tqdm=False)[0]
    return {"history_tokens": len(prompt2), "cached_tokens": out2.num_cached_tokens,
            "ttft_restart_s": out2.metrics["ttft_s"], "ttft_cold_s": cold.metrics["ttft_s"],
            "ttft_turn1_s": out1.metrics["ttft_s"], "engine_start_s": start_s, "disk_bytes_written": written,
            "disk_restore": {k: disk.get(k) for k in ("restored_bytes", "restore_s", "hit_tokens")},
            "same_tokens": out2.token_ids == cold.token_ids}


def memcpy_gbs(nbytes: int = 256 << 20, repeats: int = 5) -> float:
    """The machine's memory-copy rate (GB/s, one torch copy of nbytes, best of repeats)."""
    import torch

    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return nbytes / best / 1e9


def measure(args) -> dict:
    from transformers import AutoConfig

    from cpinfer.model.resolve import resolve_model

    hw = C.hardware(args)
    vocab = AutoConfig.from_pretrained(str(resolve_model(None))).vocab_size
    copy_before = memcpy_gbs()
    none = sessions(args, hw, vocab)
    host = sessions(args, hw, vocab, kv_host_gib=args.host_gib)
    rst = restart(args, hw, vocab)
    copy_after = memcpy_gbs()

    def rate(t):
        return t["restored_bytes"] / t["restore_s"] / 1e9 if t.get("restore_s") else None

    return {"bench": "kv-tiers", "command": command_line(args) + C.hardware_flags(hw), "cp": args.cp,
            "no_tiers": none, "host_tier": host, "restart": rst,
            "speedup_later_turns": none["ttft_later_p50_s"] / host["ttft_later_p50_s"],
            "speedup_restart": rst["ttft_cold_s"] / rst["ttft_restart_s"],
            "restore_gbs": {"host": rate(host["tiers"]["host"]), "disk": rate(rst["disk_restore"])},
            "memcpy_gbs": max(copy_before, copy_after)}


def format_report(res: dict) -> str:
    none, host, rst = res["no_tiers"], res["host_tier"], res["restart"]
    a = res["args"]
    rows = []
    for name, r in (("no tiers", none), (f"host tier {a['host_gib']} GiB/rank", host)):
        rows.append([name, f"{r['ttft_turn1_p50_s']:.2f}", f"{r['ttft_later_p50_s']:.3f}",
                     f"{100 * r['hit_rate_later']:.1f}%", r["capacity_per_rank"]])
    rr = [["cold prefill of the history (no cache)", f"{rst['ttft_cold_s']:.2f}", 0],
          ["first turn after a restart (disk tier)", f"{rst['ttft_restart_s']:.3f}", rst["cached_tokens"]]]
    gbs = res["restore_gbs"]
    tr = [["host → device restore", f"{gbs['host']:.2f}" if gbs["host"] else "-"],
          ["disk → device restore (read + CRC + copy)", f"{gbs['disk']:.2f}" if gbs["disk"] else "-"],
          ["memory copy (torch, 256 MiB)", f"{res['memcpy_gbs']:.2f}"]]
    return "\n".join([
        f"{a['sessions']} chat sessions over distinct {a['doc']}-token documents, {a['turns']} turns each "
        f"({a['question']}-token questions, {a['answer']}-token greedy answers), one after another, CP{res['cp']}, "
        f"placement shard, SmolLM2-135M-Instruct fp32; the device cache holds about {a['device_sessions']} sessions:",
        "", C.fmt_table(["", "turn 1 TTFT p50 (s)", "turn >= 2 TTFT p50 (s)", "turn >= 2 prefix hit rate",
                         "device KV tokens/rank"], rows),
        "", f"turn >= 2 TTFT, no tiers / host tier: {res['speedup_later_turns']:.1f}x", "",
        f"Restart: a conversation over a {a['restart_doc']}-token document ({rst['history_tokens']}-token history at "
        f"turn 2), disk tier, engine restarted between the turns (its start took {rst['engine_start_s']:.1f} s, "
        f"index rebuilt from {rst['disk_bytes_written'] / _GIB:.2f} GiB of entries):", "",
        C.fmt_table(["turn 2", "TTFT (s)", "cached tokens"], rr), "",
        f"TTFT, cold / after restart: {res['speedup_restart']:.1f}x; same answer: {rst['same_tokens']}", "",
        "Restore throughput (bytes restored over every rank / the slowest rank's restore time):", "",
        C.fmt_table(["", "GB/s"], tr)])


def command_line(args) -> str:
    return (f"cpinfer bench kv-tiers --cp {args.cp} --sessions {args.sessions} --doc {args.doc} --turns {args.turns} "
            f"--question {args.question} --answer {args.answer} --device-sessions {args.device_sessions} "
            f"--host-gib {args.host_gib} --restart-doc {args.restart_doc}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--cp", type=C.positive_int, default=2, help="CP size (default: 2)")
    parser.add_argument("--sessions", type=C.positive_int, default=8, help="chat sessions (default: 8)")
    parser.add_argument("--doc", type=C.positive_int, default=4096, help="document tokens per session (default: 4096)")
    parser.add_argument("--turns", type=C.positive_int, default=3, help="turns per session (default: 3)")
    parser.add_argument("--question", type=C.positive_int, default=32, help="question tokens (default: 32)")
    parser.add_argument("--answer", type=C.positive_int, default=16, help="answer tokens (default: 16)")
    parser.add_argument("--device-sessions", type=C.positive_int, default=2,
                        help="sessions the device KV cache holds (default: 2)")
    parser.add_argument("--host-gib", type=float, default=1.0, help="host tier GiB per rank (default: 1.0)")
    parser.add_argument("--restart-doc", type=C.positive_int, default=8000,
                        help="document tokens of the restart case (default: 8000)")
    C.add_common_arguments(parser)


def run(args) -> int:
    def measure_with_args(a):
        res = measure(a)
        res["args"] = {k: getattr(a, k) for k in ("sessions", "doc", "turns", "question", "answer", "device_sessions",
                                                  "host_gib", "restart_doc")}
        return res

    return C.run_measured(args, measure_with_args, format_report, "kv-tiers",
                          "KV tiers: host tier vs none over chat sessions, a restart from the disk tier")
