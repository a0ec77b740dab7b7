"""Plain-text rendering of a `Plan` and of a CP sweep, as `cpinfer plan` prints them; `--explain` adds, per
component, the formula and every profile parameter it used with its value and source."""
from __future__ import annotations

from cpinfer.perf.planner import Plan, SweepRow
from cpinfer.perf.simulator import STRATEGIES

ROWS = (  # breakdown key -> label
    ("gemm", "GEMM (TP-sharded, + LM head)"),
    ("attention", "attention kernels"),
    ("merge", "merge partial outputs"),
    ("sendrecv_exposed", "exposed SendRecv"),
    ("ring_steps", "per-step ring cost"),
    ("all2all", "All2All (pass-Q)"),
    ("allreduce", "TP all-reduce"),
    ("elementwise", "norms/activations"),
    ("kernels", "kernel slots (CUDA graphs)"),
    ("recurrence", "recurrent layers (conv + rule)"),
    ("summary_exchange", "recurrent summary exchange"),
)
HYBRID_KEYS = ("recurrence", "summary_exchange")  # shown for a hybrid model only

# component -> (how it is computed, the profile parameters it reads)
EXPLAIN = {
    "gemm": ("2*m*n*k FLOPs per GEMM on whole 128-row tiles at peak * gemm_efficiency (FP8 peak for FP8 "
             "weights), or the weight read at mem_tbps * mem_efficiency, whichever is longer",
             ("peak_tflops", "peak_tflops_fp8", "gemm_efficiency", "mem_tbps", "mem_efficiency")),
    "attention": ("per ring step, the slowest rank's block: 4 * (pairs + L0 * queries) * head_dim * heads / A_inf, "
                  "A_inf = attn_tflops * (ref/2 + L0) / (ref/2); a sliding-window layer counts only the pairs its "
                  "window shows and skips trailing empty steps; decode: flash-decoding reads K/V once",
                  ("attn_tflops", "attn_ref_tokens", "attn_overhead_tokens", "mem_tbps", "kernel_overhead_us")),
    "merge": ("N partial outputs + LSE read, output written once (App. B); pass-Q also copies the N-1 outgoing "
              "partials into the All2All buffer (Alg. 3's permute)", ("mem_tbps", "mem_efficiency")),
    "sendrecv_exposed": ("per step max(0, latency + message / BW - comm_overlap * attention): the ring overlaps "
                         "the transfer (the paper's decode does not: its Q SendRecv follows each step)",
                         ("inter_gbs", "inter_latency_us", "intra_gbs", "intra_latency_us", "devices_per_node",
                          "comm_overlap")),
    "ring_steps": ("N * ring_step_us per layer (eager prefill ring: stream sync and launches per step)",
                   ("ring_step_us",)),
    "all2all": ("pass-Q: partial outputs + fp32 LSE of the other ranks' queries, every peer posted at once: "
                "(N-1) * latency + max(bytes per peer / BW, (N-1) * bytes per peer / line rate), exposed (App. C)",
                ("inter_gbs", "inter_gbs_peak", "inter_latency_us")),
    "allreduce": ("2 per layer; NVLink ring in the node, over nodes 2*log2(nodes) latencies + the 1/8 slice at "
                  "the collective bandwidth", ("intra_gbs", "intra_latency_us", "inter_coll_gbs",
                                               "inter_latency_us")),
    "elementwise": ("norms, residuals, SwiGLU, FP8 quantization: bytes / (mem_tbps * mem_efficiency)",
                    ("mem_tbps", "mem_efficiency")),
    "kernels": ("decode under CUDA graphs: kernels per layer * kernel_overhead_us", ("kernel_overhead_us",)),
    "recurrence": ("a hybrid's recurrent layers (cpinfer/perf/hybrid.py): the conv and gated norm as memory passes; "
                   "the chunked delta rule, C (5 Dk + 3 Dv) + 6 Dk Dv FLOPs per token and value head (under CP on "
                   "Dv + Dk values: the affine map in the same pass) at A_inf; decode: each state read and written",
                   ("attn_tflops", "attn_ref_tokens", "attn_overhead_tokens", "mem_tbps", "mem_efficiency")),
    "summary_exchange": ("per recurrent layer, one all-reduce over the CP ranks of the shards' fp32 maps (M [Dk, Dk] "
                         "and B [Dk, Dv] per value head, 2N - 1 shards a sequence) and one of the conv halo rows "
                         "(decode: of the decode rows); the faster of a ring and a tree",
                         ("inter_gbs", "inter_latency_us", "intra_gbs", "intra_latency_us", "devices_per_node")),
}


def format_plan(plan: Plan) -> str:
    d, w = plan.deployment, plan.workload
    m, hw = d.model, d.hardware
    kind = "chunked attention of" if m.local == "chunked" else "sliding window of"
    windows = f", {m.window_layers} with {kind} {m.window} tokens" if m.window_layers else ""
    params = f"{m.params / 1e9:.1f}B params" + (
        f" ({m.active_params / 1e9:.1f}B active: {m.experts_per_tok} of {m.n_experts} experts on {m.moe_layers} "
        "layers)" if m.moe_layers else "")
    lines = [
        f"model     {m.name}: {params}, {m.n_layers} layers{windows}{_linear_words(m)}, {m.n_heads} heads / "
        f"{m.n_kv_heads} KV heads x {m.head_dim}; weights {d.weights.name}",
        f"hardware  {hw.name} ({hw.kind}); CP{d.cp} x TP{d.tp} = {d.gpus} devices; {d.implementation.name}'s ring",
        f"workload  batch {w.batch} x ({w.prompt_tokens} new + {w.cached_tokens} cached) tokens; "
        f"miss rate {w.prompt_tokens / w.context_tokens:.2%}",
        "",
        f"{'TTFT breakdown (s)':32s}" + "".join(f"{s:>12s}" for s in STRATEGIES),
    ]
    for key, label in ROWS:
        if key != "kernels" and (key not in HYBRID_KEYS or m.linear_layers):
            lines.append(f"  {label:30s}" + "".join(f"{plan.ttft[s].breakdown[key]:12.4f}" for s in STRATEGIES))
    lines.append(f"  {'total TTFT':30s}" + "".join(f"{plan.ttft[s].seconds:12.4f}" for s in STRATEGIES))
    lines.append(f"  {'TF/s per device (App. A count)':30s}" +
                 "".join(f"{plan.ttft[s].detail['tflops_per_gpu']:12.1f}" for s in STRATEGIES))
    kv = plan.ttft["pass-kv"].detail
    lines += [
        f"  per ring step: pass-KV message {kv['ring_message_mb']:.2f} MB, SendRecv {kv['step_sendrecv_us']:.0f} us, "
        f"attention up to {kv['step_attention_max_us']:.0f} us; {kv['padding_tokens']} padding tokens",
        *([f"  recurrent layers: summary exchange {kv['exchange_mb_per_layer']:.2f} MB per layer "
           f"({plan.ttft['pass-kv'].breakdown['summary_exchange'] / plan.ttft['pass-kv'].seconds:.1%} of TTFT), "
           f"{kv['recurrence_flops_per_layer'] / 1e12:.2f} TFLOP of recurrence per layer on the fullest device"]
          if "exchange_mb_per_layer" in kv else []),
        *([f"  multi-head latent attention: prefill costed in the "
           f"{'/'.join(dict.fromkeys(plan.ttft[s].detail['mla_form'] for s in STRATEGIES))} form (the cheaper of "
           "absorbed and expanded per-head K/V, as the engine picks); decode in the absorbed form (bytes)"]
          if "mla_form" in kv and kv["mla_form"] != "sparse" else []),
        *([f"  DeepSeek sparse attention: every layer's indexer scores all earlier keys ({m.index_heads} heads x "
           f"{m.index_dim}), attention reads the top-{m.index_topk}; its ranks exchange query rows, candidates "
           "(top-k x 16 bytes a row: the All2All line) and partials, not K/V (no ring steps); KV per token and layer: "
           f"latent {m.head_dim} + indexer key {m.index_dim}"] if kv.get("mla_form") == "sparse" else []),
        "",
        f"choice    {plan.choice.strategy} ({plan.choice.method}): {plan.choice.reason}",
        f"simulated fastest: {plan.fastest}",
        f"TTIT      {plan.ttit.seconds * 1e3:.2f} ms per decode step at {w.context_tokens} context, batch {w.batch} "
        f"({plan.ttit.detail['queries_per_rank']} on the fullest rank"
        f"{', padded to ' + str(plan.ttit.detail['padded_batch']) if plan.ttit.detail['padding_queries'] else ''}): "
        + _ttit_parts(plan),
        f"memory    {plan.memory.weights_gb:.2f} GB weights + {plan.memory.kv_gb:.2f} GB KV"
        f"{f' + {plan.memory.state_gb:.3f} GB recurrent state' if m.linear_layers else ''} = "
        f"{plan.memory.total_gb:.2f} GB per device of {plan.memory.capacity_gb:.0f} GB -> "
        f"{'fits' if plan.memory.fits else 'DOES NOT FIT'} (90% usable)",
    ]
    lines.append(f"held      {held_words(plan)}")
    lines += [f"warning   {w}" for w in plan.warnings]
    return "\n".join(lines)


def _linear_words(m) -> str:
    """A hybrid's recurrent layers and what they keep per request instead of K/V."""
    if not m.linear_layers:
        return ""
    kind = {"gdn": "Gated DeltaNet", "kda": "KDA"}[m.linear_kind]
    return (f" ({m.linear_layers} {kind}: {m.linear_v_heads} heads of {m.linear_k_dim}x{m.linear_v_dim} fp32 "
            f"state, K/V on the other {m.attn_layers} only)")


def _elem(nbytes: int, fp8: bool) -> str:
    return "FP8 (+ fp32 row scales)" if fp8 else {1: "8-bit", 2: "16-bit", 4: "fp32"}[nbytes]


def held_words(plan: Plan) -> str:
    """The weights as the engine holds them once loaded, and how decode runs."""
    d = plan.deployment
    h, m = d.held, d.model
    parts = [f"attention {_elem(h.attn_bytes, h.attn_fp8)}", f"MLPs {_elem(h.ffn_bytes, h.ffn_fp8)}"]
    if m.moe_layers:
        parts[-1] = f"dense MLPs / shared experts {_elem(h.ffn_bytes, h.ffn_fp8)}"
        parts.append(f"routed experts {_elem(h.expert_bytes, h.expert_fp8)}")
    parts.append(f"embeddings, LM head and norms {_elem(h.other_bytes, False)}"
                 f"{'' if d.implementation.vocab_parallel else ' (whole on every TP rank)'}")
    why = d.eager_decode_reason
    decode = "decode under CUDA graphs" if why is None else f"decode eager (no CUDA graphs with {why})"
    return "; ".join(parts + list(h.notes) + [decode])


def format_explain(plan: Plan) -> str:
    """Each component: its share of TTFT (chosen strategy) and TTIT, how it is computed, the parameters used."""
    hw = plan.deployment.hardware
    ttft, ttit = plan.ttft[plan.choice.strategy], plan.ttit
    lines = [f"explain   per component, TTFT of {plan.choice.strategy} and TTIT; parameters of profile "
             f"{hw.name!r} ({hw.kind})"]
    for key, label in ROWS:
        how, params = EXPLAIN[key]
        lines.append(f"  {label}: TTFT {ttft.breakdown[key]:.4f} s ({ttft.breakdown[key] / ttft.seconds:.1%}), "
                     f"TTIT {ttit.breakdown[key] * 1e3:.3f} ms")
        lines.append(f"      how: {how}")
        for name in params:
            lines.append(f"      {name} = {getattr(hw, name):g}  [{hw.sources.get(name, 'no source')}]")
    return "\n".join(lines)


def _ttit_parts(plan: Plan) -> str:
    parts = sorted(plan.ttit.breakdown.items(), key=lambda kv: -kv[1])
    return ", ".join(f"{k} {v * 1e3:.1f}" for k, v in parts if v * 1e3 >= 0.05)


def format_sweep(rows: list[SweepRow], target_s: float, plan: Plan | None) -> str:
    lines = [f"{'CP':>4s} {'TTFT (s)':>10s} {'strategy':>9s} {'GB/device':>10s} {'fits':>5s}"]
    for r in rows:
        lines.append(f"{r.cp:4d} {r.ttft_s:10.3f} {r.strategy:>9s} {r.memory_gb_per_gpu:10.2f} "
                     f"{'yes' if r.fits else 'no':>5s}")
    if plan is None:
        lines.append(f"no CP size up to {rows[-1].cp} meets TTFT <= {target_s:g} s")
    else:
        lines.append(f"smallest CP meeting TTFT <= {target_s:g} s: CP{plan.deployment.cp} "
                     f"({plan.deployment.gpus} devices, TTFT {plan.chosen_ttft_s:.3f} s)")
    return "\n".join(lines)
