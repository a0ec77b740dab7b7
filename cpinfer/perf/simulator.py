"""Simulated forward pass on CP x TP: TTFT (full / partial prefill, pass-KV or pass-Q), TTIT, memory per GPU.

Per layer on one GPU (paper §3.4, §3.5, §4.1, §4.3): the TP-sharded GEMMs (FP8 FFN, bf16 projections), memory-bound
elementwise ops, two TP all-reduces, and ring attention priced by the shared cost model `cpinfer/cp/cost_model.py`
(N steps of the slowest rank's block or the SendRecv it overlaps, a per-step cost, pass-Q's All2All, permute and
merge; sliding-window layers skip what their window hides). Decode is ring pass-Q under CUDA graphs (Alg. 4): Q
SendRecv per step, flash-decoding, All2All of the partial outputs, merge. `Implementation` says what differs between
the paper's system (the statements) and cpinfer (the default). `cpinfer/perf/fit.py` says which numbers are fitted.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

from cpinfer.cp import cost_model
from cpinfer.cp.cost_model import STRATEGIES, AttnShape
from cpinfer.cp.ring_shape import RingShape
from cpinfer.perf import costs, hybrid
from cpinfer.perf.hardware_profile import HardwareProfile
from cpinfer.perf.implementations import CPINFER, Implementation
from cpinfer.perf.model_spec import ModelSpec
from cpinfer.perf.models import HeldWeights, WeightFormat, held_weights, weight_bytes_per_gpu
from cpinfer.utils import ceil_div, check_positive

# Memory passes over one token's hidden vector per layer: two fused residual-add + RMSNorm kernels (read x and
# residual, write both and the normed x: 5 each), on the 1/TP token slice each rank norms (sequence-parallel TP).
ELEMENTWISE_HIDDEN_PASSES = 10
ELEMENTWISE_FFN_PASSES = 3       # SwiGLU on the TP shard of the FFN: read gate and up, write the product
DECODE_KERNELS_PER_LAYER = 9     # 2 norms, RoPE, KV append, 2 residuals, SwiGLU, 2 FP8 quantizations
DECODE_KERNELS_PER_RING_STEP = 2  # besides flash-decoding's two: the grouped NCCL send/recv, the Q-buffer swap
DECODE_KERNELS_AFTER_RING = 3     # permute, All2All, merge (Alg. 4)
COMPONENTS = ("gemm", "attention", "merge", "sendrecv_exposed", "ring_steps", "all2all", "allreduce",
              "elementwise", "kernels", "recurrence", "summary_exchange")  # the last two: a hybrid's recurrent layers
RING_KEYS = ("attention", "merge", "sendrecv_exposed", "ring_steps", "all2all")
# assumption: host time per kernel launch of PyTorch's eager decode path (launch + dispatch), what a decode kernel
# costs without CUDA graphs
EAGER_KERNEL_US = 8.0
USABLE_FRACTION = 0.9  # of device memory for weights + KV: the engine's default gpu_memory_utilization


@dataclass(frozen=True)
class Deployment:
    model: ModelSpec
    hardware: HardwareProfile
    cp: int                  # N, CP ranks (nodes in the paper's setup)
    tp: int                  # N_TP, GPUs per CP rank
    weights: WeightFormat
    act_bytes: int = 2       # e, activations and the Q/K/V messages
    kv_bytes: int = 2        # KV cache element size
    implementation: Implementation = field(default=CPINFER)
    kv_scale_bytes: int = 0  # per cached K or V row (token, KV head): cpinfer's FP8 KV keeps one fp32 scale

    def __post_init__(self) -> None:
        check_positive(self.cp, "cp")
        check_positive(self.tp, "tp")
        self.model.kv_heads_per_gpu(self.tp)  # validates tp against the head counts
        if self.fp8_kv and self.model.mla and not self.implementation.fp8_kv_mla:
            raise ValueError(f"model {self.model.name!r}: an FP8 KV cache is not supported for multi-head latent "
                             f"attention (MLA) models by {self.implementation.name} (its cache holds one shared "
                             "latent); plan with --kv-cache-dtype auto")
        if self.fp8_kv and self.model.mla and self.kv_scale_bytes:
            raise ValueError(f"model {self.model.name!r}: the per-token FP8 KV format is not supported for multi-head "
                             "latent attention (MLA) models (the values are the cached latent's first channels); "
                             "plan with --kv-cache-dtype fp8 (static scales)")

    @property
    def fp8_kv(self) -> bool:
        return self.kv_bytes == 1

    @property
    def held(self) -> HeldWeights:
        """The weights as this implementation holds them on this hardware (FP8 kept or dequantized, by kind)."""
        return held_weights(self.weights, self.model, self.act_bytes, self.hardware.peak_tflops_fp8 > 0,
                            self.implementation.fp8_experts)

    @property
    def eager_decode_reason(self) -> str | None:
        """What keeps decode off CUDA graphs ("an FP8 KV cache", "multi-head latent attention"), or None."""
        impl = self.implementation
        if self.fp8_kv and not impl.fp8_kv_graphs:
            return "an FP8 KV cache"
        if self.model.mla and not impl.mla_graphs:
            return "multi-head latent attention"
        return None

    @property
    def decode_graphs(self) -> bool:
        """Whether decode runs under CUDA graphs (cpinfer: not with an FP8 KV cache)."""
        return self.eager_decode_reason is None

    @property
    def gpus(self) -> int:
        return self.cp * self.tp

    @property
    def attn_shape(self) -> AttnShape:
        m = self.model
        return AttnShape(m.n_heads // self.tp, m.kv_heads_per_gpu(self.tp), m.head_dim, self.act_bytes,
                         self.implementation.partial_bytes, m.kv_parts, m.head_dim * self.kv_bytes + self.kv_scale_bytes)

    @property
    def expanded_shape(self) -> AttnShape | None:
        """MLA's expanded prefill (`cpinfer/engine/mla_form.py`): the latent's bytes, per-pair FLOPs of per-head
        keys (nope + rope) and values (v), and each latent row's up-projection (kv_b_proj) for this device's heads;
        None for other models."""
        m = self.model
        if not m.mla:
            return None
        heads = m.n_heads // self.tp
        return replace(self.attn_shape, pair_dim=(m.qk_nope_head_dim + m.qk_rope_head_dim + m.v_head_dim) // 2,
                       expand_flops=2.0 * m.kv_lora_rank * (m.qk_nope_head_dim + m.v_head_dim) * heads)

    @property
    def link(self) -> cost_model.Link:
        return self.hardware.ring_link(self.cp, self.tp)


@dataclass(frozen=True)
class Estimate:
    """A predicted latency; `breakdown` (seconds per COMPONENTS key, whole forward pass) sums to `seconds`."""
    strategy: str
    seconds: float
    breakdown: dict
    detail: dict             # per-step and per-layer numbers worth showing


def sparse_attention_layer(dep: Deployment, ring: RingShape, batch: int) -> dict:
    """One DeepSeek sparse attention layer of a prefill on the slowest rank, seconds by RING_KEYS
    (`engine/sparse_attention.py`): the ranks all-gather the query rows (absorbed query, indexer query and weights);
    each scores its ~1/N of the keys for every row (indexer FLOPs 2 x heads x (dim + 1) per visible pair, and the
    scores written once), takes its local top-k, all-gathers the candidates (top-k x 16 bytes per row); attends
    absorbed over its ~top-k/N selected latent rows per row (4 x heads x (latent + rank) / 2 per pair) and All2Alls
    the partials back to merge."""
    m, hw, n = dep.model, dep.hardware, ring.n
    shape = replace(dep.attn_shape, pair_dim=(m.head_dim + m.kv_lora_rank) // 2)
    rows = batch * ring.new  # every rank scores every row of the ring
    pairs = batch * ring.new * (ring.new / 2 + ring.cached)  # causal (query, key) pairs of the whole forward
    selected = batch * topk_pairs(ring.cached, ring.new, m.index_topk)
    flops = 2.0 * m.index_heads * (m.index_dim + 1) * pairs / n
    scores = 2 * 4.0 * pairs / n  # fp32 scores, written and read once by the top-k
    keys = (ring.cached + ring.new) / n
    index = max(flops / cost_model.attention_rate(hw), scores / cost_model.memory_rate(hw))
    attention = index + cost_model.attention_time(hw, shape, selected / n, rows, min(keys, rows * m.index_topk / n))
    link = dep.link
    lq = batch * ring.q_tokens  # this rank's rows
    row_bytes = shape.q_bytes(1) + (m.index_heads * m.index_dim + m.index_heads) * 4
    comm = (cost_model.all2all_time(lq * row_bytes, n, link) + cost_model.all2all_time(rows * m.index_topk * 16, n, link)
            + cost_model.all2all_time(shape.partial_out_bytes(lq), n, link)) if n > 1 else 0.0
    merge = cost_model.merge_time(hw, shape, lq, n) + cost_model.permute_time(hw, shape, lq, n)
    return dict(attention=attention, merge=merge, sendrecv_exposed=0.0, ring_steps=0.0, all2all=comm)


def ring_attention_layers(dep: Deployment, ring: RingShape, batch: int, strategy: str) -> tuple[dict, dict]:
    """Ring attention of every layer on one rank, seconds by RING_KEYS, and the per-step numbers of a full layer
    (a DSA model: `sparse_attention_layer` on every layer, whatever the strategy)."""
    m, shape = dep.model, dep.attn_shape
    if m.dsa:
        one = sparse_attention_layer(dep, ring, batch)
        return {k: m.n_layers * one[k] for k in RING_KEYS}, dict(step_sendrecv=0.0, step_attention_max=one["attention"],
                                                                 message_bytes=0.0, mla_form="sparse")
    full = cost_model.ring_cost(dep.hardware, shape, ring, strategy, batch=batch, tp=dep.tp)
    form = None
    if dep.expanded_shape is not None:  # MLA: the cheaper form, as the engine picks per forward
        expanded = cost_model.ring_cost(dep.hardware, dep.expanded_shape, ring, strategy, batch=batch, tp=dep.tp)
        form = "expanded" if expanded.total < full.total else "absorbed"
        full = expanded if form == "expanded" else full
    total = {k: m.full_layers * getattr(full, k) for k in RING_KEYS}
    if m.window_layers:  # sliding layers, or Llama 4's chunked ones (the chunk geometry of RingShape)
        windowed = RingShape(ring.n, ring.new, ring.cached, m.window) if m.local == "sliding" else \
            RingShape(ring.n, ring.new, ring.cached, attention_chunk=m.window)
        win = cost_model.ring_cost(dep.hardware, shape, windowed, strategy, batch=batch, tp=dep.tp)
        total = {k: total[k] + m.window_layers * getattr(win, k) for k in RING_KEYS}
    return total, dict(step_sendrecv=full.step_sendrecv, step_attention_max=full.step_attention_max,
                       message_bytes=full.message_bytes, mla_form=form)


def gemm_layer(dep: Deployment, tokens: int) -> float:
    """The GEMM groups of one layer (averaged over dense and sparse layers) on one TP rank for `tokens` rows
    (Megatron column/row sharding; each expert's intermediate dimension sliced the same way)."""
    m, w, hw, tp = dep.model, dep.held, dep.hardware, dep.tp
    shape = dep.attn_shape
    qkv_n = (shape.heads + 2 * shape.kv_heads) * m.head_dim      # KV heads replicated when tp > N_KV
    o_k = shape.heads * m.head_dim
    qkv_n += shape.heads * m.head_dim if m.attn_output_gate else 0  # the gate's half of q_proj
    t = costs.gemm_time(hw, tokens, qkv_n, m.hidden, qkv_n * m.hidden * w.attn_bytes, w.attn_fp8)
    t += costs.gemm_time(hw, tokens, m.hidden, o_k, o_k * m.hidden * w.attn_bytes, w.attn_fp8)
    if m.linear_layers:  # a hybrid: the attention layers' GEMMs and the recurrent layers', averaged over layers
        t = (m.attn_layers * t + m.linear_layers * _linear_gemms(dep, tokens)) / m.n_layers
    dense = _mlp_time(dep, tokens, m.ffn_dim // tp, w.ffn_bytes, w.ffn_fp8)
    if not m.moe_layers:
        return t + dense
    return t + ((m.n_layers - m.moe_layers) * dense + m.moe_layers * _moe_time(dep, tokens)) / m.n_layers


def _linear_gemms(dep: Deployment, tokens: int) -> float:
    """A recurrent layer's projections on one TP rank (heads split): the input projections from hidden, KDA's
    low-rank second stages, out_proj."""
    m, w, hw, tp = dep.model, dep.held, dep.hardware, dep.tp
    into, second, vd = (x // tp for x in m.linear_proj_dims)
    t = costs.gemm_time(hw, tokens, into, m.hidden, into * m.hidden * w.attn_bytes, w.attn_fp8)
    t += costs.gemm_time(hw, tokens, m.hidden, vd, vd * m.hidden * w.attn_bytes, w.attn_fp8)
    if second:
        t += costs.gemm_time(hw, tokens, second, m.linear_k_dim, second * m.linear_k_dim * w.other_bytes, False)
    return t


def _mlp_time(dep: Deployment, rows: int, ffn: int, elem: int, fp8: bool, experts: int = 1) -> float:
    """A gated MLP of intermediate `ffn` (this rank's share) over `rows` rows whose weights (`elem` bytes each, FP8
    GEMMs or not) are read `experts` times (the distinct experts a grouped GEMM touches)."""
    m, hw = dep.model, dep.hardware
    if not ffn:
        return 0.0
    t = costs.gemm_time(hw, rows, 2 * ffn, m.hidden, experts * 2 * ffn * m.hidden * elem, fp8)
    return t + costs.gemm_time(hw, rows, m.hidden, ffn, experts * ffn * m.hidden * elem, fp8)


def _moe_time(dep: Deployment, tokens: int) -> float:
    """A sparse layer: the router, the k routed (token, expert) rows grouped by expert (FLOPs of the active experts,
    weights of the experts touched: min(E, k x tokens)), and the shared expert."""
    m, hw, w = dep.model, dep.hardware, dep.held
    rows = tokens * m.experts_per_tok
    router = costs.gemm_time(hw, tokens, m.n_experts, m.hidden, m.n_experts * m.hidden * w.other_bytes, False)
    routed = _mlp_time(dep, rows, m.expert_ffn_dim // dep.tp, w.expert_bytes, w.expert_fp8, min(m.n_experts, rows))
    return router + routed + _mlp_time(dep, tokens, m.shared_ffn_dim // dep.tp, w.ffn_bytes, w.ffn_fp8)


def _dense_layer(dep: Deployment, tokens: int) -> dict:
    """GEMMs, elementwise ops and the two TP all-reduces of one layer on one GPU for `tokens` tokens."""
    m, w, hw, tp = dep.model, dep.held, dep.hardware, dep.tp
    passes = (ELEMENTWISE_HIDDEN_PASSES * m.hidden + ELEMENTWISE_FFN_PASSES * m.active_ffn_dim) / tp
    if w.ffn_fp8:  # dynamic row-wise quantization of the two FFN GEMM inputs: read + 1-byte write
        passes += 1.5 * (m.hidden + m.active_ffn_dim / tp)
    elementwise = tokens * passes * dep.act_bytes / hw.mem_bytes_per_s
    allreduce = 2 * costs.allreduce_time(hw, tokens * m.hidden * dep.act_bytes, tp)  # = RS + AG, same bytes
    return dict(gemm=gemm_layer(dep, tokens), elementwise=elementwise, allreduce=allreduce)


def _lm_head(dep: Deployment, tokens: int) -> float:
    m = dep.model
    n = ceil_div(m.vocab, dep.tp) if dep.implementation.vocab_parallel else m.vocab
    return costs.gemm_time(dep.hardware, tokens, n, m.hidden, n * m.hidden * dep.held.other_bytes, False)


def simulate_prefill(dep: Deployment, prompt_tokens: int, cached_tokens: int = 0, batch: int = 1,
                     strategy: str = "pass-kv") -> Estimate:
    """TTFT of B identical sequences, each with T new and P cached tokens, on dep.cp x dep.tp GPUs."""
    check_positive(batch, "batch")
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {', '.join(STRATEGIES)}, got {strategy!r}")
    ring = RingShape(dep.cp, prompt_tokens, cached_tokens)
    attn, step = ring_attention_layers(dep, ring, batch, strategy)
    breakdown = {k: v * dep.model.n_layers for k, v in _dense_layer(dep, batch * ring.q_tokens).items()}
    breakdown = {k: breakdown.get(k, 0.0) + attn.get(k, 0.0) for k in COMPONENTS}
    breakdown["gemm"] += _lm_head(dep, batch)
    m = dep.model
    if m.linear_layers:
        rec = hybrid.prefill_layer(dep.hardware, m, dep.cp, dep.tp, dep.link, batch * ring.q_tokens, batch,
                                   dep.act_bytes)
        breakdown["recurrence"] += m.linear_layers * rec["recurrence"]
        breakdown["summary_exchange"] += m.linear_layers * rec["summary_exchange"]
    seconds = sum(breakdown.values())
    expanded = step["mla_form"] == "expanded"
    flops = paper_flops(dep.model, prompt_tokens, cached_tokens, batch,
                        dep.expanded_shape.pair_dim if expanded else 0)
    detail = dict(chunk_tokens=ring.chunk, padding_tokens=batch * ring.padding,
                  tokens_per_rank=batch * ring.q_tokens, ring_message_mb=step["message_bytes"] / 1e6,
                  step_sendrecv_us=step["step_sendrecv"] * 1e6,
                  step_attention_max_us=step["step_attention_max"] * 1e6,
                  tflops_per_gpu=flops / seconds / dep.gpus / 1e12)
    if step["mla_form"] is not None:
        detail["mla_form"] = step["mla_form"]
    if m.linear_layers:
        detail.update(exchange_mb_per_layer=rec["exchange_bytes"] / 1e6,
                      recurrence_flops_per_layer=rec["rule_flops"])
    return Estimate(strategy, seconds, breakdown, detail)


def decode_attention_layer(dep: Deployment, context_tokens: int, batch: int, window: int = 0, rows: int = 1) -> dict:
    """Ring pass-Q decode attention of one layer (Alg. 4) on the rank holding the most queries, under CUDA graphs.

    q = ceil(B/N) queries on the fullest rank, padded or not (the ring's critical path holds that many at every
    step either way; padding adds work on the other ranks, not time). N steps of flash-decoding over this rank's
    ~context/N keys (~min(window, context)/N in a windowed layer, (context mod C + 1)/N in a chunked one), each with the next Q block's SendRecv beside it
    (overlapped) or after it (the paper's decode, §4.3); then All2All of the partial outputs, permute and merge.
    `rows` query rows per sequence (a speculative verify step: k + 1) travel as one Q block and read the K/V once.
    """
    hw, shape, n = dep.hardware, dep.attn_shape, dep.cp
    q = ceil_div(batch, n)
    keys = context_tokens
    if window:  # a sliding window's last `window` keys, or the keys of the query's own chunk so far
        keys = min(window, context_tokens) if dep.model.local == "sliding" else context_tokens % window + 1
    if dep.model.dsa:  # the indexer reads every cached indexer key, attention only the top-k latent rows
        op = _sparse_decode_time(dep, q, keys / n, rows)
    else:
        op = costs.decode_attention_time(hw, shape, q, ceil_div(keys, n), rows)
    comm = cost_model.p2p_time(shape.q_bytes(q * rows), dep.link) if n > 1 else 0.0
    hidden = hw.comm_overlap * op if dep.implementation.overlap_decode_ring else 0.0
    exposed = (n - 1) * max(0.0, comm - hidden)
    merge = cost_model.merge_time(hw, shape, q * rows, n) + cost_model.permute_time(hw, shape, q * rows, n)
    return dict(attention=n * op, sendrecv_exposed=exposed, merge=merge,
                all2all=cost_model.all2all_time(shape.partial_out_bytes(q * rows), n, dep.link), op=op, queries=q,
                step_sendrecv=comm)


def _sparse_decode_time(dep: Deployment, queries: int, keys: float, rows: int) -> float:
    """A DSA decode step's attention on one rank: every row scores this rank's `keys` indexer keys (read once per
    sequence) and attends over its ~top-k / N selected latent rows (read per row), a roofline of the two."""
    m, hw, shape = dep.model, dep.hardware, dep.attn_shape
    n = dep.cp
    picked = min(keys, m.index_topk / n)
    traffic = queries * (keys * m.index_row_bytes(dep.kv_bytes) + rows * picked * shape.kv_bytes(1))
    flops = queries * rows * (2.0 * m.index_heads * (m.index_dim + 1) * keys
                              + 2.0 * shape.heads * (m.head_dim + m.kv_lora_rank) * picked)
    slot = hw.kernel_overhead_us * 1e-6
    return max(slot, traffic / cost_model.memory_rate(hw), flops / cost_model.attention_rate(hw)) + slot


def decode_kernels_time(dep: Deployment, eager: bool) -> float:
    """Kernel slots of one decode-shaped forward: per layer its kernels and the ring's, each a CUDA-graph slot, or
    when `eager` a host launch (EAGER_KERNEL_US)."""
    ring_kernels = DECODE_KERNELS_PER_RING_STEP * dep.cp + DECODE_KERNELS_AFTER_RING if dep.cp > 1 else 0
    slot_us = max(EAGER_KERNEL_US, dep.hardware.kernel_overhead_us) if eager else dep.hardware.kernel_overhead_us
    m = dep.model  # a hybrid's recurrent layers have no ring
    return (m.n_layers * DECODE_KERNELS_PER_LAYER + m.attn_layers * ring_kernels) * slot_us * 1e-6


def simulate_decode(dep: Deployment, context_tokens: int, batch: int = 1, rows: int = 1) -> Estimate:
    """TTIT: one decode step of `batch` sequences with `context_tokens` cached each (ring pass-Q decode).

    `rows` > 1: a speculative verify step, the same ring under the same CUDA graph with `rows` (= k + 1) query rows
    per sequence: one Q block per step, the K/V read once, GEMMs, LM head and All2All over batch x rows rows."""
    check_positive(context_tokens, "context tokens")
    check_positive(batch, "batch")
    check_positive(rows, "query rows per sequence")
    m = dep.model
    att = decode_attention_layer(dep, context_tokens, batch, rows=rows)
    keys = ("attention", "sendrecv_exposed", "merge", "all2all")
    per = {k: m.full_layers * att[k] for k in keys}
    if m.window_layers:
        win = decode_attention_layer(dep, context_tokens, batch, m.window, rows)
        per = {k: per[k] + m.window_layers * win[k] for k in keys}
    q = att["queries"]
    breakdown = {k: v * m.n_layers for k, v in _dense_layer(dep, q * rows).items()}
    breakdown["kernels"] = decode_kernels_time(dep, eager=not dep.decode_graphs)
    breakdown = {k: breakdown.get(k, 0.0) + per.get(k, 0.0) for k in COMPONENTS}
    breakdown["gemm"] += _lm_head(dep, q * rows)
    if m.linear_layers:  # every rank advances every sequence's state (its replica)
        rec = hybrid.decode_layer(dep.hardware, m, dep.cp, dep.tp, dep.link, batch, rows, dep.act_bytes)
        breakdown["recurrence"] += m.linear_layers * rec["recurrence"]
        breakdown["summary_exchange"] += m.linear_layers * rec["summary_exchange"]
    padded = q * dep.cp if dep.implementation.pad_decode_batch else batch
    detail = dict(queries_per_rank=q, padded_batch=padded, padding_queries=padded - batch,
                  attention_op_us=att["op"] * 1e6, step_sendrecv_us=att["step_sendrecv"] * 1e6,
                  queries_computed_per_layer=padded * dep.cp, cuda_graphs=dep.decode_graphs, rows_per_seq=rows)
    return Estimate("pass-q" if dep.cp > 1 else "local", sum(breakdown.values()), breakdown, detail)


@dataclass(frozen=True)
class Memory:
    weights_gb: float
    kv_gb: float
    capacity_gb: float
    state_gb: float = 0.0    # a hybrid's recurrent states (fp32) and conv tails, one per request

    @property
    def total_gb(self) -> float:
        return self.weights_gb + self.kv_gb + self.state_gb

    @property
    def usable_gb(self) -> float:
        """90% of device memory (the engine's default gpu_memory_utilization); the rest for activations and
        workspace."""
        return USABLE_FRACTION * self.capacity_gb

    @property
    def fits(self) -> bool:
        """Weights + KV within the usable share of device memory."""
        return self.total_gb <= self.usable_gb


def memory_per_gpu(dep: Deployment, tokens_per_seq: int, batch: int = 1) -> Memory:
    """Weights (TP-sharded) and the KV cache of `batch` sequences of `tokens_per_seq` (CP-sharded). Windowed layers
    keep every token's K/V too (cpinfer's KV cache does not trim what a window no longer sees). A hybrid: K/V of its
    attention layers only, plus each request's recurrent state on every CP rank (heads TP-sharded)."""
    weights = weight_bytes_per_gpu(dep.model, dep.held, dep.tp, dep.implementation.vocab_parallel)
    kv_tokens = batch * 2 * dep.cp * ceil_div(tokens_per_seq, 2 * dep.cp) / dep.cp
    kv = kv_tokens * dep.model.kv_bytes_per_token(dep.tp, dep.kv_bytes, dep.kv_scale_bytes)
    return Memory(weights / 1e9, kv / 1e9, dep.hardware.mem_gb,
                  hybrid.state_gb(dep.model, dep.tp, batch, dep.act_bytes))


def paper_flops(model: ModelSpec, new: int, cached: int = 0, batch: int = 1, pair_dim: int = 0) -> float:
    """App. A: 2*W*T*B GEMM FLOPs (W: the active weights of a mixture of experts) + 4*B*T*(T/2 + P)*D*layers
    attention FLOPs (causal half for new tokens); a sliding-window layer counts the pairs its window shows, sum
    over new tokens of min(W, position + 1), a chunked layer those of its chunk, sum of (position mod C) + 1; a
    hybrid's recurrent layers add the chunked delta rule's FLOPs (`hybrid.rule_flops`) per token and value head.
    `pair_dim`: D per head when it is not head_dim (MLA's expanded form: (nope + rope + v) / 2)."""
    if model.dsa:  # the indexer's pairs at its width, attention (absorbed) over each query's top-k
        index = 2.0 * model.index_heads * (model.index_dim + 1) * new * (new / 2 + cached)
        attend = 2.0 * model.n_heads * (model.head_dim + model.kv_lora_rank) * topk_pairs(cached, new,
                                                                                           model.index_topk)
        return 2.0 * model.active_params * new * batch + batch * model.n_layers * (index + attend)
    d = model.n_heads * (pair_dim or model.head_dim)
    pairs = new * (new / 2 + cached) * model.full_layers
    if model.window_layers:
        local = _chunk_pairs if model.local == "chunked" else _window_pairs
        pairs += model.window_layers * local(cached + 1, cached + new, model.window)
    recurrent = model.linear_layers * model.linear_v_heads * hybrid.token_flops(model, 1) * new * batch
    return 2.0 * model.active_params * new * batch + 4.0 * batch * pairs * d + recurrent


def topk_pairs(cached: int, new: int, k: int) -> int:
    """(query, key) pairs a top-k selection attends: sum of min(k, cached + i + 1) over the new tokens i."""
    a = max(0, min(new, k - cached))  # queries that see fewer than k keys: all of them
    return a * cached + a * (a + 1) // 2 + (new - a) * k


def _chunk_pairs(lo: int, hi: int, chunk: int) -> int:
    """sum of ((x - 1) mod chunk) + 1 over the integers x in [lo, hi] (keys a chunked query at position x - 1 sees)."""
    def upto(n: int) -> int:
        full, rest = divmod(n, chunk)
        return full * chunk * (chunk + 1) // 2 + rest * (rest + 1) // 2

    return upto(hi) - upto(lo - 1)


def _window_pairs(lo: int, hi: int, window: int) -> int:
    """sum of min(x, window) over the integers x in [lo, hi]."""
    below = max(0, min(hi, window) - lo + 1)  # terms with x <= window
    first = lo if below else 0
    return below * (first + first + below - 1) // 2 + (hi - lo + 1 - below) * window
