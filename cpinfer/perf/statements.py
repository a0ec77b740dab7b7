"""Every quantitative statement of the paper's public text, as checks of the performance model (paper §1-§4, App. A).

Each `Statement` names its source (section and sentence), what the model computes for it on a hardware profile,
the paper's value and the tolerance it is checked at. `kind` is "value" (within `tol` relative) or "holds" (a
comparison the model must satisfy). `fit` marks the values `cpinfer.perf.fit` fits the h100-gtt parameters to;
the others are predictions. Setup everywhere (§4.1): Llama3-405B, row-wise FP8 FFN, TP8 per node, batch 1; the
paper's "128K" and "1M" are 128,000 and 1,000,000 tokens (App. A arithmetic, §4.2.4).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import lru_cache
from typing import Callable

import numpy as np

from cpinfer.cp.cost_model import AttnShape, attention_time
from cpinfer.perf.catalog import HARDWARE
from cpinfer.perf.hardware_profile import HardwareProfile
from cpinfer.perf.implementations import PAPER
from cpinfer.perf.model_catalog import MODELS
from cpinfer.perf.models import WEIGHT_FORMATS
from cpinfer.perf.planner import Workload, choose
from cpinfer.perf.simulator import (Deployment, decode_attention_layer, memory_per_gpu, paper_flops, simulate_decode,
                                    simulate_prefill)

K128, M1 = 128_000, 1_000_000
L405 = MODELS["llama3-405b"]


@dataclass(frozen=True)
class Statement:
    key: str
    source: str                               # section / table / sentence
    quote: str                                # the statement, shortened
    kind: str                                 # "value" | "holds"
    model: Callable[[HardwareProfile], float]  # value, or a margin that must be > 0 for "holds"
    paper: float = 0.0
    tol: float = 0.10
    fit: bool = False
    gti: bool = False                         # evaluated on the GTI profile (same GPUs, TCP network)

    def __post_init__(self) -> None:
        if self.kind not in ("value", "holds"):
            raise ValueError(f"statement {self.key}: kind must be 'value' or 'holds', got {self.kind!r}")
        if self.kind == "value" and (self.paper == 0 or not self.tol > 0):
            raise ValueError(f"statement {self.key}: a value needs the paper's number and a positive tolerance")
        if self.fit and self.kind != "value":
            raise ValueError(f"statement {self.key}: only values can be fitted")

    def error(self, hw: HardwareProfile) -> float:
        """Relative error of a value statement."""
        return self.model(hw) / self.paper - 1.0

    def passes(self, hw: HardwareProfile) -> bool:
        return abs(self.error(hw)) <= self.tol if self.kind == "value" else self.model(hw) > 0


def dep(hw: HardwareProfile, cp: int, tp: int = 8) -> Deployment:
    """The paper's setup (§4.1) run by the paper's implementation (padded decode, bf16 partial outputs)."""
    return Deployment(L405, hw, cp, tp, WEIGHT_FORMATS["fp8-ffn"], implementation=PAPER)


def with_network(hw: HardwareProfile, net: str) -> HardwareProfile:
    """`hw`'s GPU numbers with the network of catalog profile `net` (GTI = the GTT GPUs on TCP, §4.1)."""
    other = HARDWARE[net]
    fields = ("inter_gbs_peak", "inter_gbs", "inter_coll_gbs")
    return dataclasses.replace(hw, name=f"{hw.name}+{net}-net", **{f: getattr(other, f) for f in fields},
                               inter_latency_us=hw.inter_latency_us * other.inter_latency_us /
                               HARDWARE["h100-gtt"].inter_latency_us)


@lru_cache(maxsize=4096)
def ttft(hw: HardwareProfile, cp: int, t: int, p: int = 0, strategy: str = "pass-kv", tp: int = 8):
    return simulate_prefill(dep(hw, cp, tp), t, p, strategy=strategy)


@lru_cache(maxsize=1024)
def ttit(hw: HardwareProfile, cp: int, context: int, tp: int = 8):
    return simulate_decode(dep(hw, cp, tp), context)


def _ratio_kv_q(hw, t):
    return ttft(hw, 4, t, K128 - t, "pass-kv").seconds / ttft(hw, 4, t, K128 - t, "pass-q").seconds


def _kv_step(hw, t):
    """(SendRecv, attention) per pass-KV ring step, seconds, CP4 at T+P=128000 (the columns of Table 5)."""
    d = ttft(hw, 4, t, K128 - t, "pass-kv").detail
    return d["step_sendrecv_us"] * 1e-6, d["step_attention_max_us"] * 1e-6


def _exposed_vs_all2all(hw, t):
    """(N-1)(SendRecv - Attn) of pass-KV minus pass-Q's All2All, per layer (§4.2.4, App. C)."""
    send, attn = _kv_step(hw, t)
    a2a = ttft(hw, 4, t, K128 - t, "pass-q").breakdown["all2all"] / L405.n_layers
    return 3 * (send - attn) - a2a


def _choice(hw, t):
    """The heuristic `cpinfer plan` and the engine use by default (Alg. 5) at CP4, T new of P+T = 128000."""
    return choose(dep(hw, 4), Workload(t, K128 - t), "alg5")


def _picks_kv_by(hw, ts, condition):
    """Margin of "pass-KV is chosen at every T, and `condition` ("eq1", "eq2") is met": the smallest relative
    distance past the condition's threshold, or -1 when a pick is pass-Q or the condition fails."""
    margins = []
    for t in ts:
        c = _choice(hw, t)
        if condition == "eq2":
            margin = t / c.inputs["kv_token_threshold"] - 1
        else:
            margin = c.inputs["miss_rate"] / (2 * L405.n_kv_heads / L405.n_heads) - 1
        margins.append(margin if c.strategy == "pass-kv" and margin >= 0 else -1.0)
    return min(margins)


def _picks_q(hw, ts):
    """+1 when the heuristic picks pass-Q at every T, else -1."""
    return 1.0 if all(_choice(hw, t).strategy == "pass-q" for t in ts) else -1.0


def _pick_within(hw, t, tol):
    """tol minus how much slower (model) the heuristic's pick is than the faster strategy at T."""
    times = {s: ttft(hw, 4, t, K128 - t, s).seconds for s in ("pass-kv", "pass-q")}
    return tol - (times[_choice(hw, t).strategy] / min(times.values()) - 1)


def _linearity(hw, strategy):
    """R^2 of a straight line through TTFT vs miss rate T/(T+P) over the §4.2.4 grid (CP4, P+T = 128000)."""
    ts = [1280, 2560, 3200, 6400, 12800, 25600, 32000, 64000, K128]
    y = np.asarray([ttft(hw, 4, t, K128 - t, strategy).seconds for t in ts])
    x = np.asarray(ts) / K128
    fit = np.polyval(np.polyfit(x, y, 1), x)
    return 1 - ((y - fit) ** 2).sum() / ((y - y.mean()) ** 2).sum()


def _fa3_8k(hw):
    """The model's attention rate on the paper's standalone benchmark: one H100, causal 8K, 128 heads."""
    n = int(hw.attn_ref_tokens)
    seconds = attention_time(hw, AttnShape(128, 8, 128, 2), n * (n + 1) / 2, n, n)
    return 4 * n * n / 2 * 128 * 128 / seconds / 1e12


def _all():
    S = Statement
    tt = lambda cp, t, tp=8: (lambda hw: ttft(hw, cp, t, tp=tp).seconds)  # noqa: E731
    ratio = lambda a, b: (lambda hw: a(hw) / b(hw))  # noqa: E731
    out = [
        S("ttft_cp16_1m", "Abstract; §4.2.3 'exact prefill in 77 seconds for a 1M context length'",
          "1M prefill on CP16 (128 H100) in 77 s", "value", tt(16, M1), 77.0, fit=True),
        S("ttft_cp16_128k", "Abstract; §4.2.3 '3.8 seconds for a 128K context length'",
          "128K prefill on CP16 in 3.8 s", "value", tt(16, K128), 3.8, fit=True),
        S("ttft_cp8_128k", "§4.2.1 'with CP8 on GTT ... 128K token prefill in 5.85 seconds'",
          "128K prefill on CP8 (GTT) in 5.85 s", "value", tt(8, K128), 5.85, fit=True),
        *[S(f"halving_cp{n}_cp{2 * n}", "§4.2.1 'latency for the same input length is halved as we double the "
            "number of CP nodes' (GTT, 1-8 nodes, 128K)", f"TTFT(CP{n}) / TTFT(CP{2 * n}) = 2 at 128K", "value",
            ratio(tt(n, K128), tt(2 * n, K128)), 2.0, fit=True) for n in (1, 2, 4)],
        S("tflops_1m", "App. A '4.9e18 / 77 / 128 = 502 TF/sec'; §4.2.3",
          "502 TF/s per H100 at 1M on CP16 (App. A FLOP count)", "value",
          lambda hw: ttft(hw, 16, M1).detail["tflops_per_gpu"], 502.0),
        S("parallel_efficiency_1m", "§4.2.3 '502 TF/sec ... compared to ... 540 TF/sec ... 93% parallelization "
          "efficiency'", "achieved / standalone FA3 8K = 93%", "value",
          lambda hw: ttft(hw, 16, M1).detail["tflops_per_gpu"] / _fa3_8k(hw), 0.93),
        S("flops_utilization_1m", "§4.2.3 'approximately 63% FLOPS utilization'; App. A (800 TF/s BF16 peak)",
          "achieved / 800 TF/s = 63%", "value",
          lambda hw: ttft(hw, 16, M1).detail["tflops_per_gpu"] / hw.peak_tflops, 0.63),
        S("fa3_8k", "App. A 'standalone Flash Attention v3 causal attention benchmark using 8K ... 540 TF/sec'",
          "FA3 causal 8K on one H100: 540 TF/s", "value", _fa3_8k, 540.0),
        S("near_linear_1m_cp8_cp16", "Abstract 'near-linear scaling for long-context prefill latency with up to 128 "
          "H100 GPUs across 16 nodes'", "TTFT(CP8) / TTFT(CP16) = 2 at 1M", "value",
          ratio(tt(8, M1), tt(16, M1)), 2.0),
        *[S(f"superlinear_{lo // 1000}k_cp{cp}", "§4.2.3 'more than 2x increase in TTFT with a 2x increase in "
            "context length for >= 512K token prefill' (Figure 10: CP8 and CP16)",
            f"TTFT({'1M' if hi == M1 else f'{hi // 1000}K'}) / TTFT({lo // 1000}K) > 2 on CP{cp}", "holds",
            (lambda cp, lo, hi: lambda hw: ttft(hw, cp, hi).seconds / ttft(hw, cp, lo).seconds - 2)(cp, lo, hi))
          for cp in (8, 16) for lo, hi in ((256_000, 512_000), (512_000, M1))],
        S("single_host_1m", "§1 'or 1200 seconds to serve 1M context length' (one host, 8 H100)",
          "1M prefill on one TP8 host: 1200 s", "value", tt(1, M1), 1200.0, fit=True),
        S("single_host_128k", "§1 'it can take 60 seconds to serve 128K context length' (one host)",
          "128K prefill on one TP8 host: ~60 s (conflicts with 5.85 s x 8 halving, see docs/planning.md)",
          "value", tt(1, K128), 60.0),
        S("tp16_vs_cp2", "§4.2.2 'the latency is different by roughly 15% between CP2 and TP16 on 2 nodes'",
          "TTFT(TP16) / TTFT(CP2) = 1.15 at 128K", "value", ratio(tt(1, K128, 16), tt(2, K128)), 1.15),
        S("tp64_vs_cp8", "§4.2.2 'the difference drastically increases to 100% when scaled to 8 nodes'",
          "TTFT(TP64) / TTFT(CP8) = 2.0 at 128K", "value", ratio(tt(1, K128, 64), tt(8, K128)), 2.0),
        S("tp_scaling_below_cp", "§4.2.2 Figure 9: TP's scaling ratio falls further behind CP's with more nodes",
          "TTFT(TP64)/TTFT(CP8) > TTFT(TP16)/TTFT(CP2)", "holds",
          lambda hw: tt(1, K128, 64)(hw) / tt(8, K128)(hw) - tt(1, K128, 16)(hw) / tt(2, K128)(hw)),
        S("gti_cp1_cp2", "§4.2.1 'For GTI ... we observe the same scalability with up to 4 nodes'",
          "GTI: TTFT(CP1) / TTFT(CP2) = 2 at 128K", "value", ratio(tt(1, K128), tt(2, K128)), 2.0, gti=True),
        S("gti_cp2_cp4", "§4.2.1, same sentence", "GTI: TTFT(CP2) / TTFT(CP4) = 2 at 128K", "value",
          ratio(tt(2, K128), tt(4, K128)), 2.0, gti=True),
        S("gti_like_gtt_cp4", "Abstract 'Benchmarks on H100 GPU hosts inter-connected with RDMA and TCP both show "
          "similar scalability'; §4.2.1", "TTFT on GTI = TTFT on GTT at CP4, 128K", "value",
          lambda hw: ttft(with_network(hw, "h100-gti"), 4, K128).seconds / ttft(hw, 4, K128).seconds, 1.0),
        S("gti_hidden_cp4", "§4.2.1 'roughly 3GB/s per rank, which is still enough to overlap the pass-KV "
          "communication with attention compute'", "GTI CP4 128K: pass-KV SendRecv hidden (exposed < 1%)",
          "holds", lambda hw: 0.01 - ttft(hw, 4, K128).breakdown["sendrecv_exposed"] / ttft(hw, 4, K128).seconds,
          gti=True),
        S("tipping_5pct", "§4.2.4 'The tipping point ... occurs at T=6400 (5% KV cache miss rate)'; 'Around 5% "
          "... the differences between pass-KV and pass-Q is less than 1%'", "CP4, T=6400, P+T=128000: "
          "pass-KV / pass-Q = 1 within 1%", "value", lambda hw: _ratio_kv_q(hw, 6400), 1.0, tol=0.01, fit=True),
        *[S(f"pass_q_wins_{t}", "§4.2.4 'When the KV cache miss rate is less than 5%, pass-Q exhibits better "
            "latency'", f"CP4, T={t}: pass-Q faster", "holds", (lambda t: lambda hw: _ratio_kv_q(hw, t) - 1)(t))
          for t in (1280, 2560, 3200)],
        *[S(f"pass_kv_wins_{t}", "§4.2.4 'when the miss rate exceeds 5%, pass-KV achieves lower latency'; "
            "'exceeds 12.5% ... pass-KV is always selected'", f"CP4, T={t}: pass-KV faster", "holds",
            (lambda t: lambda hw: 1 - _ratio_kv_q(hw, t))(t)) for t in (12800, 16000, 32000, 64000, K128)],
        S("hidden_at_10pct", "§4.2.4 'At 10% ... SendRecv hidden under Attn' (Table 5)",
          "CP4, T=12800: pass-KV SendRecv per step < Attn per step", "holds",
          lambda hw: _kv_step(hw, 12800)[1] - _kv_step(hw, 12800)[0]),
        S("exposed_below_3_25pct", "§4.2.4 'When cache miss rate falls below 3.25%, pass-KV communication "
          "becomes exposed'", "CP4, T=3200: pass-KV SendRecv per step > Attn per step", "holds",
          lambda hw: _kv_step(hw, 3200)[0] - _kv_step(hw, 3200)[1]),
        S("exposed_beats_all2all_2_5pct", "§4.2.4 'for T = 3200, the sum of exposed pass-KV communication "
          "((N-1)(SendRecv - Attn)) is longer than pass-Q All2All'", "CP4, T=3200: (N-1)(SendRecv-Attn) > "
          "All2All", "holds", lambda hw: _exposed_vs_all2all(hw, 3200)),
        S("choice_above_12_5pct", "§4.2.4 'When the KV cache miss rate exceeds 12.5% ... pass-KV is always "
          "selected, meeting the 2nd condition in Algorithm 1'", "CP4, T/(T+P) in 15-50%: the heuristic picks "
          "pass-KV, miss rate >= 2 N_KV / N_H", "holds", lambda hw: _picks_kv_by(hw, (19200, 25600, 32000, 64000),
                                                                               "eq1")),
        S("choice_10pct", "§4.2.4 'At 10% KV cache miss rate, pass-KV remains the choice since the number of new "
          "tokens T is sufficiently large, satisfying Equation 2'", "CP4, T=12800: the heuristic picks pass-KV, "
          "T >= Eq. 2's threshold", "holds", lambda hw: _picks_kv_by(hw, (12800,), "eq2")),
        S("choice_5pct", "§4.2.4 'Around 5% cache miss rate (e.g., T=6400), the differences between pass-KV and "
          "pass-Q is less than 1%, allowing for either option to be selected'", "CP4, T=6400: the heuristic's "
          "pick within 1% of the faster (model)", "holds", lambda hw: _pick_within(hw, 6400, 0.01)),
        S("choice_below_3_25pct", "§4.2.4 'When cache miss rate falls below 3.25%, pass-KV communication becomes "
          "exposed, leading to the selection of pass-Q. Specifically, at a 2.5% cache miss rate ... resulting in "
          "the selection of pass-Q'", "CP4, T in 1280-4000 (1-3.125%): the heuristic picks pass-Q", "holds",
          lambda hw: _picks_q(hw, (1280, 2560, 3200, 4000))),
        *[S(f"linear_in_miss_rate_{s}", "§4.2.4 'TTFT latency is linearly proportional to the persistent KV "
            "cache miss rate'", f"CP4 {s}: TTFT vs T/(T+P) on a straight line, R^2 >= 0.99", "holds",
            (lambda s: lambda hw: _linearity(hw, s) - 0.99)(s)) for s in ("pass-kv", "pass-q")],
        S("ttit_cp4_128k", "§4.3 'TTIT for scaling CP increases to 71 ms' (CP4, 128K, batch 1)",
          "CP4 decode TTIT 71 ms", "value", lambda hw: ttit(hw, 4, K128).seconds, 0.071, fit=True),
        S("ttit_tp32_128k", "§4.3 'TTIT for scaling TP increases to 47 ms' (TP32, 128K, batch 1)",
          "TP32 decode TTIT 47 ms", "value", lambda hw: ttit(hw, 1, K128, 32).seconds, 0.047, fit=True),
        S("ttit_grows_with_cp", "§4.3 'TTIT tends to be longer for ... scaling CP'; 'using 4 nodes can result in "
          "worse TTIT than using a single node'", "TTIT: TP8 < CP2 < CP4 at 128K", "holds",
          lambda hw: min(ttit(hw, 2, K128).seconds - ttit(hw, 1, K128).seconds,
                         ttit(hw, 4, K128).seconds - ttit(hw, 2, K128).seconds)),
        S("ttit_grows_with_tp", "§4.3 'TTIT tends to be longer for both scaling TP'",
          "TTIT: TP8 < TP32 at 128K", "holds",
          lambda hw: ttit(hw, 1, K128, 32).seconds - ttit(hw, 1, K128).seconds),
        *[S(f"ttit_flat_{name}", "§4.3 'the TTIT of both TP8 and CP2 does not increase too much' (Table 8, "
            "context lengths up to 128K)", f"{name}: TTIT(128K) / TTIT(8K) < 1.25", "holds",
            (lambda cp: lambda hw: 1.25 - ttit(hw, cp, K128).seconds / ttit(hw, cp, 8000).seconds)(cp))
          for name, cp in (("tp8", 1), ("cp2", 2))],
        S("decode_attn_op_faster_with_cp", "§4.3 'as we increase the number of hosts, the effective length seen "
          "by each attention kernel decreases, so each individual attention op becomes faster'",
          "decode attention op at 128K: CP4 < CP2 < CP1", "holds",
          lambda hw: min(_decode_op(hw, 1) - _decode_op(hw, 2), _decode_op(hw, 2) - _decode_op(hw, 4))),
        S("decode_pass_q_total_grows", "§4.3 'the total pass-Q attention latency and TTIT increase with CP'",
          "ring pass-Q decode attention per layer at 128K: CP4 > CP2 > CP1", "holds",
          lambda hw: min(_decode_total(hw, 2) - _decode_total(hw, 1), _decode_total(hw, 4) - _decode_total(hw, 2))),
        S("gemm_flops_1m", "App. A 'GEMM FLOPS = 2 x 405B x 1M = 8.1e17'", "GEMM FLOPs at 1M", "value",
          lambda hw: 2.0 * L405.params * M1, 8.1e17, tol=0.02),
        S("attn_flops_1m", "App. A 'ATTN FLOPS = 1/2 x 1M^2 x 16384 x 126 = 4.1e18'", "attention FLOPs at 1M",
          "value", lambda hw: paper_flops(L405, M1) - 2.0 * L405.params * M1, 4.1e18, tol=0.05),
        S("total_flops_1m", "App. A 'The total FLOPS is 4.9e18'", "total FLOPs at 1M", "value",
          lambda hw: paper_flops(L405, M1), 4.9e18, tol=0.02),
        S("miss_rate_threshold", "§4.2.4 'exceeds 12.5% (= 2 N_KV / N_H in Equation 1)'",
          "2 N_KV / N_H = 12.5% for Llama3-405B", "value", lambda hw: 2 * L405.n_kv_heads / L405.n_heads, 0.125,
          tol=1e-9),
        S("q_vs_kv_heads", "§3.2 'communicating KV heads has 16x smaller message sizes than ... query heads'",
          "N_H / N_KV = 16 for Llama3-405B (per head; K and V together are 8x smaller than Q)", "value",
          lambda hw: L405.n_heads / L405.n_kv_heads, 16.0, tol=1e-9),
        S("fits_one_host", "§4.1 'the entire 405B model fits into one node with TP8' (row-wise FP8)",
          "weights + 128K KV fit one H100 at TP8", "holds",
          lambda hw: 0.9 * hw.mem_gb - memory_per_gpu(dep(hw, 1), K128).total_gb),
        S("fits_1m_cp8", "§4.2.3 '1M context prefill over 8 and 16 GTT nodes'", "1M KV fits on CP8 x TP8",
          "holds", lambda hw: 0.9 * hw.mem_gb - memory_per_gpu(dep(hw, 8), M1).total_gb),
    ]
    return out


def _decode_op(hw, cp):
    return decode_attention_layer(dep(hw, cp), K128, 1)["op"]


def _decode_total(hw, cp):
    a = decode_attention_layer(dep(hw, cp), K128, 1)
    return a["attention"] + a["sendrecv_exposed"] + a["merge"] + a["all2all"]


STATEMENTS: tuple[Statement, ...] = tuple(_all())
BY_KEY = {s.key: s for s in STATEMENTS}


def profile_for(statement: Statement, hw: HardwareProfile) -> HardwareProfile:
    """The profile a statement is evaluated on: `hw`, or `hw`'s GPUs on the GTI network."""
    return with_network(hw, "h100-gti") if statement.gti else hw


def evaluate(hw: HardwareProfile | None = None) -> list[dict]:
    """Every statement on `hw` (default h100-gtt): model value, paper value, error, pass/fail."""
    hw = hw or HARDWARE["h100-gtt"]
    rows = []
    for s in STATEMENTS:
        h = profile_for(s, hw)
        value = s.model(h)
        rows.append(dict(key=s.key, source=s.source, quote=s.quote, kind=s.kind, model=value, paper=s.paper,
                         error=(value / s.paper - 1) if s.kind == "value" else None, tol=s.tol, fit=s.fit,
                         passes=s.passes(h)))
    return rows
