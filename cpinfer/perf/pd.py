"""Prefill and decode on separate groups of ranks: TTFT on the prefill group (CP-N x TP), the one KV transfer to a
decode group (CP-M x TP), and TTIT there, against decoding on the prefill group itself (paper §4.3: "context
parallel is best suited for improving prefill performance ... a serving system that decouples the parallelization
scheme for prefill and decode").

The transfer: each prefill device sends the K/V of the tokens it holds (its TP rank's KV heads; MLA's latent; an
FP8 cache's stored bytes; a sliding-window layer only the window decode still needs) to the decode device of the
same TP rank that owns them in the decode group's layout (the 2M-chunk load balancing of §3.5.1), batched per
(source, destination, layer). Sent per layer as it is written, it hides behind the layers still to compute.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from fractions import Fraction

from cpinfer.cp import cost_model
from cpinfer.perf.planner import Plan
from cpinfer.perf.simulator import Deployment, Estimate, Memory, memory_per_gpu, simulate_decode
from cpinfer.utils import ceil_div, check_positive


def layout_overlap(n: int, m: int) -> list[list[Fraction]]:
    """share[s][d]: the fraction of a sequence's tokens that prefill rank s holds (2N-chunk layout) and decode rank d
    owns (2M-chunk layout), for a sequence long enough that chunk rounding does not matter. Rows sum to 1/N,
    columns to 1/M."""
    check_positive(n, "prefill CP size")
    check_positive(m, "decode CP size")
    units = math.lcm(2 * n, 2 * m)  # the sequence in equal units, each inside one chunk of either layout

    def rank(unit: int, ranks: int) -> int:
        chunk = unit * 2 * ranks // units
        return min(chunk, 2 * ranks - 1 - chunk)

    share = [[Fraction(0)] * m for _ in range(n)]
    for u in range(units):
        share[rank(u, n)][rank(u, m)] += Fraction(1, units)
    return share


@dataclass(frozen=True)
class Transfer:
    """The K/V of one prefill moved to one decode group, as the busiest device's NIC sees it."""
    tokens: int                  # tokens whose K/V move (per sequence)
    batch: int                   # sequences
    bytes_per_token: float       # per device (its TP rank's heads), all layers (a windowed layer counted only for
    #                              the tokens its window keeps, averaged over the sequence)
    model_bytes_per_token: float  # the model's K/V per token over all heads (TP copies of a replicated head once)
    total_bytes: float           # over the network, every TP rank's share (replicated heads sent by each rank)
    receiver_bytes: float        # into the busiest decode device
    flows_in: int                # prefill devices sending to one decode device
    flows_out: int               # decode devices one prefill device sends to
    link: cost_model.Link        # per flow, latency, line rate one device's flows share
    intra_node: bool             # both groups in one node (NVLink) or across nodes (the network)
    layers: int
    seconds: float               # the whole transfer sent after the prefill's forward ends
    exposed_s: float             # sent per layer as written: what is left after the prefill's last layer

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out["link"] = dict(flow_gbs=self.link.bandwidth / 1e9, latency_us=self.link.latency * 1e6,
                           line_rate_gbs=self.link.aggregate / 1e9)
        return out


def _kv_bytes(dep: Deployment, tokens: int) -> tuple[float, float]:
    """(bytes per device, bytes of the model over all heads) per token of a `tokens`-token sequence's K/V, all
    layers; sliding-window layers send only the last `window` tokens (what decode still reads), chunked layers
    those of the last chunk, averaged over the sequence."""
    m = dep.model
    row = dep.kv_bytes * m.head_dim + dep.kv_scale_bytes
    per_layer_dev = m.kv_parts * m.kv_heads_per_gpu(dep.tp) * row
    per_layer_model = m.kv_parts * m.kv_heads_per_gpu(1) * row
    kept = tokens
    if m.window_layers:
        kept = min(m.window, tokens) if m.local == "sliding" else (tokens % m.window or m.window)
    layer_tokens = m.full_layers * tokens + m.window_layers * kept
    return layer_tokens * per_layer_dev / tokens, layer_tokens * per_layer_model / tokens


def estimate_transfer(prefill: Deployment, decode_cp: int, groups: int, tokens: int, batch: int,
                      prefill_s: float) -> Transfer:
    """Time to move `batch` sequences of `tokens` tokens from the prefill group to decode groups (sequences spread
    over the groups; the busiest group's devices are timed). A device's time: the longer of its largest flow at the
    per-flow rate and all its bytes at its line rate (as an All2All, cost_model.all2all_time), plus one message
    latency per layer. Overlapped: layer l's K/V leaves when layer l is done, one layer after another on the link,
    so what remains after the prefill's last layer is max(one layer's transfer, transfer - prefill + one layer's
    compute)."""
    check_positive(tokens, "transferred tokens")
    m, n, tp = prefill.model, prefill.cp, prefill.tp
    share = layout_overlap(n, decode_cp)
    per_token, model_per_token = _kv_bytes(prefill, tokens)
    dev_bytes = per_token * tokens  # one sequence, one device's share of the heads
    per_group = ceil_div(batch, groups)
    link = cost_model.ring_link(prefill.hardware, n + groups * decode_cp, tp)
    intra = (n + groups * decode_cp) * tp <= prefill.hardware.devices_per_node  # ring_link's NVLink case
    # decode device d: every prefill device of its TP rank sends it share[s][d] of each sequence (one flow each)
    recv = [sum(share[s][d] for s in range(n)) for d in range(decode_cp)]
    flow_max = max(share[s][d] for s in range(n) for d in range(decode_cp))
    into = max(recv) * per_group * dev_bytes
    out_of = max(sum(row) for row in share) * batch * dev_bytes  # a prefill device sends to every group
    flows_in = max(sum(1 for s in range(n) if share[s][d]) for d in range(decode_cp))
    flows_out = max(sum(1 for d in range(decode_cp) if share[s][d]) for s in range(n)) * min(groups, batch)
    streaming = max(float(flow_max) * per_group * dev_bytes / link.bandwidth,
                    float(into) / link.aggregate, float(out_of) / link.aggregate)
    layers = m.attn_layers  # the layers that hold K/V (a hybrid's recurrent layers hold a state instead)
    seconds = streaming + layers * link.latency
    per_layer = seconds / layers
    exposed = max(per_layer, seconds - prefill_s + prefill_s / layers)
    return Transfer(tokens, batch, per_token, model_per_token, batch * tp * dev_bytes, float(into), flows_in, flows_out,
                    link, intra, layers, seconds, exposed)


@dataclass(frozen=True)
class PDPlan:
    """A request prefilled on CP-N x TP, its K/V moved once, decoded on one of K groups of CP-M x TP."""
    prefill: Plan                # the prefill group's plan: TTFT, and its own (colocated) TTIT and memory
    decode: Deployment           # one decode group
    groups: int                  # K decode groups
    batch_per_group: int         # sequences one decode group decodes (the batch spread over the groups)
    ttit: Estimate               # a decode step on the decode group
    memory: Memory               # one decode device: weights + the K/V of its sequences
    transfer: Transfer

    @property
    def gpus(self) -> int:
        return (self.prefill.deployment.cp + self.groups * self.decode.cp) * self.decode.tp

    @property
    def colocated_ttit(self) -> Estimate:
        return self.prefill.ttit

    @property
    def second_token_s(self) -> float:
        """From the request's arrival to its second token: TTFT, the transfer left after the prefill, one step."""
        return self.prefill.chosen_ttft_s + self.transfer.exposed_s + self.ttit.seconds

    def to_dict(self) -> dict:
        return dict(decode_cp=self.decode.cp, decode_tp=self.decode.tp, groups=self.groups, gpus=self.gpus,
                    batch_per_group=self.batch_per_group, ttft_s=self.prefill.chosen_ttft_s,
                    transfer=self.transfer.to_dict(), ttit_s=self.ttit.seconds,
                    ttit_breakdown_s=dict(self.ttit.breakdown), colocated_ttit_s=self.colocated_ttit.seconds,
                    second_token_s=self.second_token_s, decode_memory_gb_per_gpu=self.memory.total_gb,
                    decode_kv_gb_per_gpu=self.memory.kv_gb, decode_fits=self.memory.fits)


def plan_pd(prefill: Plan, decode_cp: int, groups: int = 1) -> PDPlan:
    """The P/D prediction for `prefill` (a plan on the prefill group) decoded on `groups` groups of CP-`decode_cp`
    with the prefill group's TP. The K/V of the prompt's new tokens move; a cached prefix is counted as already
    held by the decode group (it decoded the earlier turns)."""
    check_positive(decode_cp, "--pd-decode-cp (decode group CP size)")
    check_positive(groups, "--pd-decode-groups (decode groups)")
    dep, work = prefill.deployment, prefill.workload
    decode = dataclasses.replace(dep, cp=decode_cp)
    per_group = ceil_div(work.batch, groups)
    ttit = simulate_decode(decode, work.context_tokens, per_group)
    memory = memory_per_gpu(decode, work.context_tokens, per_group)
    transfer = estimate_transfer(dep, decode_cp, groups, work.prompt_tokens, work.batch, prefill.chosen_ttft_s)
    return PDPlan(prefill, decode, groups, per_group, ttit, memory, transfer)


def format_pd(pd: PDPlan) -> str:
    """The P/D part of `cpinfer plan --pd-decode-cp M`, after the prefill group's plan."""
    p, d, t = pd.prefill.deployment, pd.decode, pd.transfer
    hw = p.hardware
    where = "NVLink inside one node" if t.intra_node else "the network between nodes"
    flow_src = "intra_gbs" if t.intra_node else "inter_gbs"
    line_src = "intra_gbs" if t.intra_node else "inter_gbs_peak"
    kv = "FP8" if d.fp8_kv else f"{d.kv_bytes * 8}-bit"
    what = "latent" if d.model.mla else "K/V"
    lines = [
        f"P/D       prefill CP{p.cp} x TP{p.tp} ({p.gpus} devices) -> {pd.groups} decode group"
        f"{'s' if pd.groups > 1 else ''} of CP{d.cp} x TP{d.tp} ({d.gpus} devices each); {pd.gpus} devices in all; "
        f"batch {pd.prefill.workload.batch} -> {pd.batch_per_group} per decode group",
        f"TTFT      {pd.prefill.chosen_ttft_s:.3f} s on the prefill group ({pd.prefill.choice.strategy}); the first "
        "token comes from the prefill ranks",
        f"transfer  {t.tokens} tokens x {t.bytes_per_token / 1e3:.1f} KB per token per device ({kv} {what}, "
        f"{d.model.attn_layers} layers; {t.model_bytes_per_token / 1e3:.1f} KB per token for the model) = "
        f"{t.receiver_bytes / 1e9:.2f} GB into each decode device, {t.total_bytes / 1e9:.2f} GB in all",
        f"          over {where}: {t.link.aggregate / 1e9:.1f} GB/s per device ({line_src}: "
        f"{hw.sources.get(line_src, '')}), at most {t.link.bandwidth / 1e9:.1f} GB/s per flow ({flow_src}); "
        f"{t.flows_in} prefill device{'s' if t.flows_in > 1 else ''} send to each decode device",
        f"          total {t.seconds:.3f} s if sent after the prefill; sent per layer as written: "
        f"{t.exposed_s * 1e3:.2f} ms exposed after the prefill's last layer",
        f"TTIT      {pd.ttit.seconds * 1e3:.2f} ms on CP{d.cp} x TP{d.tp} vs {pd.colocated_ttit.seconds * 1e3:.2f} ms "
        f"colocated on CP{p.cp} x TP{p.tp} ({pd.colocated_ttit.seconds / pd.ttit.seconds:.2f}x)",
        f"2nd token {pd.second_token_s:.3f} s after arrival (TTFT + exposed transfer + one decode step)",
        f"memory    decode device: {pd.memory.weights_gb:.2f} GB weights + {pd.memory.kv_gb:.2f} GB KV = "
        f"{pd.memory.total_gb:.2f} GB of {pd.memory.capacity_gb:.0f} GB -> "
        f"{'fits' if pd.memory.fits else 'DOES NOT FIT'} (90% usable)",
    ]
    if pd.memory.weights_gb > pd.memory.usable_gb:
        lines.append("warning   the weights alone exceed a decode device's usable memory: CP does not shard them; "
                     "raise --tp or use devices with more memory")
    elif not pd.memory.fits:
        lines.append("warning   the decode group cannot hold this context: raise --pd-decode-cp"
                     f"{'' if d.fp8_kv else ' or use an FP8 KV cache (--kv-cache-dtype fp8)'}")
    if d.model.linear_layers:
        state = d.model.linear_state_bytes(d.tp, d.kv_bytes)
        lines.append(f"state     each request's recurrent state ({state / 1e6:.1f} MB per device, {d.model.linear_layers} "
                     "layers) travels with its K/V rows to every decode rank (fixed size, not counted above)")
    return "\n".join(lines)
