"""Where a CPU prefill's and a decode step's time goes, through the engine (issue 51, must 1).

    PYTHONPATH=. python scripts/cpu_profile.py [--prompt 3000] [--threads 2] [--decode-steps 8] [--repeats 1]

The embedded model (SmolLM2-135M-Instruct) at CP1 in float32 (rank 0 runs in this process, as `cpinfer generate` /
`serve --cp 1` run it): one cold `--prompt`-token prompt (random ids) is prefilled with the engine's steps under
torch.profiler, then `--decode-steps` decode steps at that context. Labels around the engine's step, the rank's
execute / forward / sampling, every attention call and every RoPE call split the time; top-level aten ops under
them are sorted by kind. Shares of the profiled time are what to compare (the profiler adds a cost per op, and a
busy machine slows everything); the load average is printed beside them.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import time
from collections import defaultdict

import torch

from cpinfer.bench.decode_floor import LINEAR_OPS as LAYER_LINEAR_OPS

STEP, EXECUTE, FORWARD, ATTN, ROPE, NORM, SAMPLE = ("cpinfer.step", "cpinfer.execute", "cpinfer.forward",
                                                    "cpinfer.attention", "cpinfer.rope", "cpinfer.norm",
                                                    "cpinfer.sample")
LABELS = (STEP, EXECUTE, FORWARD, ATTN, ROPE, NORM, SAMPLE)
# a Linear's top-level op in the layers (decode_floor's list: F.linear, oneDNN's packed GEMM, cpinfer's small-batch
# kernel over the weight or its interleaved copy; model/cpu_gemm.py), and the LM head's matmul / mm besides
LINEAR_OPS = LAYER_LINEAR_OPS + ("aten::matmul", "aten::mm")
ROWS = (  # (key, what the row says)
    ("linears", "Linears in the layers (q/k/v/o, gate/up/down)"),
    ("lm_head", "LM head (rows computed: see below)"),
    ("attn_kernel", "attention kernels (cpinfer's CPU flash and batched decode, aten's flash)"),
    ("attn_rest", "attention: merges, copies, its Python"),
    ("kv_write", "K/V cache writes (index_copy_)"),
    ("norms", "RMSNorm"),
    ("rope", "RoPE (q and k)"),
    ("small_ops", "other ops in the layers: embedding, SiLU·mul, residual adds"),
    ("layer_python", "Python and dispatch in the layers"),
    ("sampling", "sampling (without the LM head)"),
    ("rank_host", "rank host work: planning, tables, results"),
    ("driver", "driver: scheduler, batch, outputs (the driver <-> rank hop: none at CP1, same process)"),
)


@contextlib.contextmanager
def labelled(llm, runner):
    """record_function ranges around the engine's step, the rank's execute / forward / sampling, every attention
    call, every layer's RoPE and every RMSNorm; put back on exit."""
    from cpinfer.engine.attention import BatchAttention
    from cpinfer.model.norms import RMSNorm

    def wrap(fn, name):
        def inner(*a, **kw):
            with torch.profiler.record_function(name):
                return fn(*a, **kw)
        return inner

    eng, model = llm.engine, runner.model
    run = BatchAttention.run
    eng.step, runner.execute = wrap(eng.step, STEP), wrap(runner.execute, EXECUTE)
    model.forward, runner._sample = wrap(model.forward, FORWARD), wrap(runner._sample, SAMPLE)
    BatchAttention.run = wrap(run, ATTN)
    attns = [layer.self_attn for layer in model.model.layers if hasattr(layer, "self_attn")]
    ropes = [a.rope for a in attns]  # an instance attribute (a plain function)
    for a, r in zip(attns, ropes):
        a.rope = wrap(r, ROPE)
    norms = [m for m in model.modules() if isinstance(m, RMSNorm)]
    for m in norms:
        m.forward = wrap(m.forward, NORM)
    try:
        yield
    finally:
        BatchAttention.run = run
        for a, r in zip(attns, ropes):
            a.rope = r
        for m in norms:
            del m.__dict__["forward"]
        for obj, name in ((eng, "step"), (runner, "execute"), (model, "forward"), (runner, "_sample")):
            del obj.__dict__[name]


def classify(events) -> dict:
    """Seconds per row of ROWS over the profiled steps (label spans give wall time with Python; top-level aten ops
    directly under a label give their own time), plus "total" and the LM head's rows."""
    span, ops = defaultdict(float), defaultdict(float)
    head_rows = []
    for e in events:
        chain, p = [], e.cpu_parent
        while p is not None:
            if p.name in LABELS:
                chain.append(p.name)
            p = p.cpu_parent
        if STEP not in chain and e.name != STEP:
            continue
        s = e.cpu_time_total * 1e-6
        if e.name in LABELS:
            span[e.name] += s
            continue
        if e.cpu_parent is None or e.cpu_parent.name not in LABELS:
            continue  # not a top-level op
        where = chain[0]
        if e.name == "aten::index_copy_":
            ops["kv_write"] += s
            ops["kv_write_in_attn"] += s if where == ATTN else 0.0
        elif where == ATTN:
            if "flash_attention" in e.name or e.name == "cpinfer::decode_attention":
                ops["attn_kernel"] += s
        elif e.name in LINEAR_OPS and where == SAMPLE:
            ops["lm_head"] += s
        elif e.name in LAYER_LINEAR_OPS and where == FORWARD:
            ops["linears"] += s
        elif where == FORWARD:
            ops["small_ops"] += s
    out = {k: ops[k] for k in ("linears", "lm_head", "attn_kernel", "kv_write", "small_ops")}
    out["norms"] = span[NORM]
    out["attn_rest"] = span[ATTN] - ops["attn_kernel"] - ops["kv_write_in_attn"]
    out["rope"] = span[ROPE]
    out["layer_python"] = (span[FORWARD] - ops["linears"] - span[ATTN] - (ops["kv_write"] - ops["kv_write_in_attn"])
                           - span[NORM]
                           - ops["small_ops"] - span[ROPE])
    out["sampling"] = span[SAMPLE] - ops["lm_head"]
    out["rank_host"] = span[EXECUTE] - span[FORWARD] - span[SAMPLE]
    out["driver"] = span[STEP] - span[EXECUTE]
    out["total"] = span[STEP]
    return out


def lm_head_rows(runner) -> list[int]:
    """The rows of every compute_logits call from now on (wraps the model's method)."""
    rows: list[int] = []
    model = runner.model
    inner = model.compute_logits

    def counting(hidden):
        rows.append(int(hidden.shape[0]))
        return inner(hidden)
    model.compute_logits = counting
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompt", type=int, default=3000)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--decode-steps", type=int, default=8)
    ap.add_argument("--batch", type=int, default=1, help="requests of --prompt tokens at once (a batched decode step)")
    ap.add_argument("--repeats", type=int, default=1, help="profiled prefills (each a fresh prompt)")
    ap.add_argument("--json", default=None, help="write the numbers here")
    args = ap.parse_args()

    from cpinfer import LLM, SamplingParams
    from cpinfer.bench import common as C
    from cpinfer.bench.decode_floor import embedded_model, in_process_runner
    from cpinfer.model.config import ModelConfig

    model = embedded_model()
    vocab = ModelConfig.from_pretrained(model).vocab_size
    load0 = os.getloadavg()
    res = {"prompt": args.prompt, "batch": args.batch, "threads": args.threads, "prefill": [], "decode": [], "wall_prefill_s": []}
    with LLM(model, context_parallel_size=1, threads_per_rank=args.threads, placement="local", dtype="float32",
             max_kv_tokens_per_rank=C.kv_capacity(args.batch * (args.prompt + args.decode_steps + 64))) as llm:
        eng, runner = llm.engine, in_process_runner(llm)
        res["torch_threads"] = torch.get_num_threads()
        llm.generate(C.random_prompt(64, vocab, seed=999), SamplingParams(max_tokens=4, ignore_eos=True),
                     use_tqdm=False)  # warm-up
        rows = lm_head_rows(runner)
        for rep in range(args.repeats):
            rids = [f"profile-{rep}-{b}" for b in range(args.batch)]
            for b, rid in enumerate(rids):
                eng.add_request(rid, C.random_prompt(args.prompt, vocab, seed=rep * args.batch + b + 1),
                                SamplingParams(max_tokens=args.decode_steps + 3, temperature=0.0, ignore_eos=True))
            rows.clear()
            with labelled(llm, runner), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as p:
                t0, steps = time.perf_counter(), 0
                while not all(eng.requests[r].out for r in rids):
                    eng.step()
                    steps += 1
                wall = time.perf_counter() - t0
            res["prefill"].append(classify(p.events()))
            res["wall_prefill_s"].append(wall)
            res["prefill_steps"], res["lm_head_rows_prefill"] = steps, list(rows)
            eng.step()  # a warm-up decode step
            rows.clear()
            with labelled(llm, runner), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as p:
                for _ in range(args.decode_steps):
                    eng.step()
            d = classify(p.events())
            res["decode"].append({k: v / args.decode_steps for k, v in d.items()})
            res["lm_head_rows_decode"] = rows[:1]
            while any(r in eng.requests for r in rids):
                eng.step()
    res["load_before"], res["load_after"] = load0, os.getloadavg()
    print(report(res))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)


def _avg(dicts: list[dict]) -> dict:
    return {k: sum(d[k] for d in dicts) / len(dicts) for k in dicts[0]}


def report(res: dict) -> str:
    pre, dec = _avg(res["prefill"]), _avg(res["decode"])
    lines = [f"| where the time goes (profiled) | prefill of {res['prompt']} tokens: s (share) | "
             f"a decode step at ~{res['prompt']} tokens: ms (share) |", "|---|---|---|"]
    for key, text in ROWS:
        lines.append(f"| {text} | {pre[key]:.2f} ({100 * pre[key] / pre['total']:.0f}%) | "
                     f"{1000 * dec[key]:.1f} ({100 * dec[key] / dec['total']:.0f}%) |")
    lines.append(f"| profiled total (the profiler's own cost included) | {pre['total']:.2f} | "
                 f"{1000 * dec['total']:.1f} |")
    lines.append("")
    lines.append(f"engine steps for the prefill: {res['prefill_steps']}; LM head rows per step: prefill "
                 f"{res['lm_head_rows_prefill']}, decode {res['lm_head_rows_decode']}; torch threads "
                 f"{res['torch_threads']}; load average {tuple(round(x, 2) for x in res['load_before'])} before, "
                 f"{tuple(round(x, 2) for x in res['load_after'])} after")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
