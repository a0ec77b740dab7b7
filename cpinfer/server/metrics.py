"""Prometheus metrics of the server (`GET /metrics`, via prometheus_client, one registry per app), and the periodic
stats log line.

Latency histograms and request outcomes are recorded by the routes; everything the engine counts (tokens, the
prefix-cache hits that persistent KV gives, §3.3, KV tokens per CP rank, forwards by phase and pass-KV / pass-Q
strategy, preemptions, queue sizes, the attention backend `auto` chose) is read from `AsyncLLM.stats()` at scrape
time. The series vLLM's dashboards read are exported under vLLM's names too (`vllm:*`, labels model_name and
engine), beside the `cpinfer_*` series.
"""
from __future__ import annotations

import dataclasses
import threading
import time
from typing import Any, Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from cpinfer.utils import get_logger

log = get_logger()
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000, 200000,
                  500000, 1000000)
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 60.0, 120.0, 300.0)
OUTCOMES = ("stop", "length", "abort", "rejected", "error")


def _as_dict(stats: Any) -> dict:
    if dataclasses.is_dataclass(stats):
        return dataclasses.asdict(stats)
    return dict(stats)


class EngineCollector:
    """Reads the engine's counters when Prometheus scrapes; an engine that cannot answer only sets `engine_dead`."""

    def __init__(self, stats: Callable[[], Any], is_dead: Callable[[], bool], model_name: str):
        self._stats, self._is_dead, self._model = stats, is_dead, model_name

    def collect(self):
        label = {"model_name": self._model}
        dead = GaugeMetricFamily("cpinfer_engine_dead", "1 once a rank died and the engine stopped", labels=["model_name"])
        is_dead = bool(self._is_dead())
        dead.add_metric([self._model], 1.0 if is_dead else 0.0)
        yield dead
        try:
            s = _as_dict(self._stats())
        except Exception:  # noqa: BLE001 - a dead engine must not break the scrape
            return

        def counter(name, doc, value):
            fam = CounterMetricFamily(name, doc, labels=list(label))
            fam.add_metric(list(label.values()), float(value))
            return fam

        def gauge(name, doc, value):
            fam = GaugeMetricFamily(name, doc, labels=list(label))
            fam.add_metric(list(label.values()), float(value))
            return fam

        yield counter("cpinfer_prompt_tokens", "prompt tokens of admitted requests", s.get("prompt_tokens", 0))
        yield counter("cpinfer_generation_tokens", "generated tokens", s.get("generation_tokens", 0))
        yield counter("cpinfer_prefix_cache_queries", "prompt tokens looked up in the prefix cache",
                      s.get("prefix_cache_queries", 0))
        yield counter("cpinfer_prefix_cache_hits", "prompt tokens whose K/V came from the prefix cache",
                      s.get("prefix_cache_hits", 0))
        yield counter("cpinfer_preemptions", "requests preempted to free KV blocks", s.get("preemptions", 0))
        yield gauge("cpinfer_num_requests_running", "requests running in the engine", s.get("num_running", 0))
        yield gauge("cpinfer_num_requests_waiting", "requests waiting to be scheduled", s.get("num_waiting", 0))
        kv = GaugeMetricFamily("cpinfer_kv_tokens_used", "KV-cache tokens stored on each CP rank",
                               labels=["model_name", "cp_rank"])
        for rank, used in enumerate(s.get("kv_tokens_per_rank", [])):
            kv.add_metric([self._model, str(rank)], float(used))
        yield kv
        yield gauge("cpinfer_kv_capacity_tokens", "KV-cache capacity of each CP rank in tokens",
                    s.get("kv_capacity_per_rank", 0))
        fwd = CounterMetricFamily("cpinfer_forwards", "forward passes by phase and ring strategy",
                                  labels=["model_name", "phase", "strategy"])
        for key, count in sorted(s.get("forwards", {}).items()):
            phase, _, strategy = str(key).partition("/")
            fwd.add_metric([self._model, phase, strategy or "none"], float(count))
        yield fwd
        yield from _tier_metrics(self._model, s.get("tiers") or {})
        yield from _pd_metrics(self._model, s.get("pd") or {})
        yield from _vllm_engine_metrics(self._model, s)
        yield from _spec_metrics(self._model, s.get("spec") or {})
        if s.get("attention_backend"):
            info = GaugeMetricFamily("cpinfer_attention_backend_info", "the attention backend rank 0 runs (1)",
                                     labels=["model_name", "backend"])
            info.add_metric([self._model, s["attention_backend"]], 1.0)
            yield info
        timed = GaugeMetricFamily("cpinfer_attention_backend_timing_ms",
                                  "auto's timing of each usable attention backend at first use (causal prefill; "
                                  "+Inf: failed)", labels=["model_name", "backend"])
        for name, ms in sorted((s.get("attention_timings_ms") or {}).items()):
            timed.add_metric([self._model, name], float(ms))
        yield timed
        fin = CounterMetricFamily("cpinfer_engine_requests_finished", "requests the engine finished, by reason",
                                  labels=["model_name", "reason"])
        for reason, count in sorted(s.get("requests_finished", {}).items()):
            fin.add_metric([self._model, str(reason)], float(count))
        yield fin


_TIER_METRICS = (  # (stat key, metric name, help, counter?)
    ("hit_tokens", "cpinfer_kv_tier_hit_tokens", "prompt tokens whose cached K/V were found in this KV tier", True),
    ("restored_tokens", "cpinfer_kv_tier_restored_tokens", "tokens restored to the device from this tier", True),
    ("restored_bytes", "cpinfer_kv_tier_restored_bytes", "K/V bytes restored to the device from this tier", True),
    ("restore_s", "cpinfer_kv_tier_restore_seconds", "time spent restoring K/V from this tier (slowest rank)", True),
    ("written_bytes", "cpinfer_kv_tier_written_bytes", "K/V bytes written to this tier's files", True),
    ("write_errors", "cpinfer_kv_tier_write_errors", "failed writes of this tier's entries", True),
    ("bytes", "cpinfer_kv_tier_bytes", "K/V bytes this tier holds now", False),
    ("capacity_bytes", "cpinfer_kv_tier_capacity_bytes", "this tier's bound in bytes", False),
)


def _tier_metrics(model: str, tiers: dict):
    """Per KV tier (device, host, disk): hits, bytes held, restores (tokens, bytes, seconds) and disk writes."""
    for key, name, doc, is_counter in _TIER_METRICS:
        fam = (CounterMetricFamily if is_counter else GaugeMetricFamily)(name, doc, labels=["model_name", "tier"])
        for tier, st in tiers.items():
            value = st.get(key)
            if value is not None:
                fam.add_metric([model, tier], float(value))
        yield fam


_PD_METRICS = (  # (stat key, metric name, help) of prefill / decode groups
    ("transfer_bytes", "cpinfer_pd_transfer_bytes", "K/V bytes moved between the prefill and decode groups"),
    ("transfer_s", "cpinfer_pd_transfer_seconds", "seconds from queueing a K/V transfer to its arrival, summed"),
    ("transfers", "cpinfer_pd_transfers", "K/V transfers between the prefill and decode groups"),
    ("move_back_bytes", "cpinfer_pd_move_back_bytes", "answers' K/V bytes moved back to the prefill group"),
)


def _pd_metrics(model: str, pd: dict):
    """Prefill / decode groups: transfer counters and each role's share of wall time spent in forwards."""
    if not pd:
        return
    for key, name, doc in _PD_METRICS:
        fam = CounterMetricFamily(name, doc, labels=["model_name"])
        fam.add_metric([model], float(pd.get(key, 0)))
        yield fam
    util = GaugeMetricFamily("cpinfer_pd_role_utilization", "share of wall time each role's ranks spent in calls",
                             labels=["model_name", "role"])
    for role, share in sorted(pd.get("utilization", {}).items()):
        util.add_metric([model, role], float(share))
    yield util


def _spec_metrics(model: str, spec: dict):
    """Speculative decoding (nothing when the engine does not speculate): vLLM's counters (verify steps, drafted and
    accepted tokens, accepted drafts by position) and cpinfer's emitted tokens, acceptance rate and mean accepted
    length per verify step."""
    if not spec:
        return
    labels, values = ["model_name", "engine"], [model, _ENGINE]
    for key, name, doc in (("num_drafts", "vllm:spec_decode_num_drafts", "verify steps (requests with drafts)"),
                           ("num_draft_tokens", "vllm:spec_decode_num_draft_tokens", "drafted tokens"),
                           ("num_accepted_tokens", "vllm:spec_decode_num_accepted_tokens", "accepted drafted tokens"),
                           ("num_emitted_tokens", "cpinfer_spec_decode_num_emitted_tokens",
                            "tokens verify steps emitted (accepted drafts + the target's own token)"),
                           ("verify_fallbacks", "cpinfer_spec_decode_verify_fallbacks",
                            "decode forwards with verify rows that the static / CUDA-graph decode path could not "
                            "take (run eagerly)")):
        fam = CounterMetricFamily(name, doc, labels=labels)
        fam.add_metric(values, float(spec.get(key, 0)))
        yield fam
    pos = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos", "accepted drafted tokens by their "
                              "position in the draft", labels=[*labels, "position"])
    for i, count in enumerate(spec.get("accepted_per_pos", [])):
        pos.add_metric([*values, str(i)], float(count))
    yield pos
    for key, name, doc in (("acceptance_rate", "cpinfer_spec_decode_acceptance_rate",
                            "accepted / drafted tokens since start"),
                           ("mean_accepted_length", "cpinfer_spec_decode_mean_accepted_length",
                            "accepted drafted tokens per verify step since start")):
        fam = GaugeMetricFamily(name, doc, labels=labels)
        fam.add_metric(values, float(spec.get(key, 0.0)))
        yield fam


class ServerMetrics:
    """The collectors of one app: request outcomes and latency histograms, plus the engine's counters."""

    def __init__(self, model_name: str, stats: Callable[[], Any], is_dead: Callable[[], bool]):
        self.registry = CollectorRegistry()
        self.model_name = model_name
        labels = ["model_name"]
        self.requests = Counter("cpinfer_requests", "HTTP generation requests by outcome (finish reason, "
                                "rejected = 4xx, error = 5xx)", ["model_name", "endpoint", "outcome"],
                                registry=self.registry)
        self.ttft = Histogram("cpinfer_time_to_first_token_seconds", "time to first token", labels,
                              buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.itl = Histogram("cpinfer_inter_token_latency_seconds", "time between two output tokens", labels,
                             buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.e2e = Histogram("cpinfer_e2e_request_latency_seconds", "request arrival to last token", labels,
                             buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.vllm = _VllmHistograms(model_name, self.registry)
        for endpoint in ("completions", "chat"):
            for outcome in OUTCOMES:
                self.requests.labels(model_name, endpoint, outcome)  # export zeros from the start
        self.registry.register(EngineCollector(stats, is_dead, model_name))

    def outcome(self, endpoint: str, outcome: str) -> None:
        self.requests.labels(self.model_name, endpoint, outcome).inc()

    def latencies(self, ttft_s: float | None, itl_s: list[float], e2e_s: float, prompt_tokens: int | None = None,
                  generation_tokens: int | None = None) -> None:
        if ttft_s is not None:
            self.ttft.labels(self.model_name).observe(ttft_s)
        itl = self.itl.labels(self.model_name)
        for dt in itl_s:
            itl.observe(dt)
        self.e2e.labels(self.model_name).observe(e2e_s)
        self.vllm.observe(ttft_s, itl_s, e2e_s, prompt_tokens, generation_tokens)

    def render(self) -> bytes:
        return generate_latest(self.registry)


# ---------------------------------------------------------------------------------------------- vLLM's names
_ENGINE = "0"  # vLLM labels every series with its engine index; one engine here


def _vllm_engine_metrics(model: str, s: dict):
    """The engine-state series vLLM's reference dashboard reads, under vLLM's names and labels."""
    labels, values = ["model_name", "engine"], [model, _ENGINE]

    def one(kind, name, doc, value):
        fam = kind(name, doc, labels=labels)
        fam.add_metric(values, float(value))
        return fam

    used = s.get("kv_tokens_per_rank") or []
    capacity = (s.get("kv_capacity_per_rank") or 0) * len(used)
    usage = sum(used) / capacity if capacity else 0.0
    yield one(GaugeMetricFamily, "vllm:num_requests_running", "requests running in the engine", s.get("num_running", 0))
    yield one(GaugeMetricFamily, "vllm:num_requests_waiting", "requests waiting to be scheduled",
              s.get("num_waiting", 0))
    yield one(GaugeMetricFamily, "vllm:kv_cache_usage_perc", "fraction of the KV cache in use over every CP rank "
              "(1 = full)", usage)
    yield one(GaugeMetricFamily, "vllm:gpu_cache_usage_perc", "vllm:kv_cache_usage_perc under vLLM's older name",
              usage)
    yield one(CounterMetricFamily, "vllm:prompt_tokens", "prompt tokens of requests whose prefill finished, cached "
              "ones included", s.get("request_prompt_tokens", 0))
    yield one(CounterMetricFamily, "vllm:generation_tokens", "generated tokens", s.get("generation_tokens", 0))
    yield one(CounterMetricFamily, "vllm:prefix_cache_queries", "prompt tokens looked up in the prefix cache",
              s.get("prefix_cache_queries", 0))
    yield one(CounterMetricFamily, "vllm:prefix_cache_hits", "prompt tokens found in the prefix cache",
              s.get("prefix_cache_hits", 0))
    yield one(CounterMetricFamily, "vllm:num_preemptions", "requests preempted to free KV blocks",
              s.get("preemptions", 0))
    fin = CounterMetricFamily("vllm:request_success", "finished requests by finish reason",
                              labels=[*labels, "finished_reason"])
    for reason, count in sorted(s.get("requests_finished", {}).items()):
        fin.add_metric([*values, str(reason)], float(count))
    yield fin


class _VllmHistograms:
    """The per-request histograms of vLLM's dashboard: TTFT, inter-token latency (and its older per-request mean,
    time per output token), end-to-end latency, prompt and generation lengths."""

    def __init__(self, model: str, registry: CollectorRegistry):
        labels, self._values = ["model_name", "engine"], (model, _ENGINE)

        def hist(name, doc, buckets=_LATENCY_BUCKETS):
            return Histogram(name, doc, labels, buckets=buckets, registry=registry).labels(*self._values)

        self.ttft = hist("vllm:time_to_first_token_seconds", "time to first token")
        self.itl = hist("vllm:inter_token_latency_seconds", "time between two output tokens")
        self.tpot = hist("vllm:time_per_output_token_seconds", "mean time per output token after the first, per "
                                                               "request")
        self.e2e = hist("vllm:e2e_request_latency_seconds", "request arrival to last token")
        self.prompt = hist("vllm:request_prompt_tokens", "prompt tokens per request", _TOKEN_BUCKETS)
        self.generation = hist("vllm:request_generation_tokens", "generated tokens per request", _TOKEN_BUCKETS)

    def observe(self, ttft_s, itl_s: list[float], e2e_s: float, prompt_tokens, generation_tokens) -> None:
        if ttft_s is not None:
            self.ttft.observe(ttft_s)
        for dt in itl_s:
            self.itl.observe(dt)
        if itl_s:
            self.tpot.observe(sum(itl_s) / len(itl_s))
        self.e2e.observe(e2e_s)
        if prompt_tokens is not None:
            self.prompt.observe(prompt_tokens)
        if generation_tokens is not None:
            self.generation.observe(generation_tokens)


# ---------------------------------------------------------------------------------------------- the stats log line
class StatsLogger:
    """One log line every `interval` seconds while there is traffic: prompt and generation throughput, running and
    waiting requests, KV usage per CP rank, the prefix-cache hit rate over the interval, and the speculative
    acceptance over it when the engine speculates."""

    def __init__(self, stats: Callable[[], Any], interval: float, clock: Callable[[], float] = time.monotonic):
        if not interval > 0:
            raise ValueError(f"the stats interval must be > 0 seconds, got {interval!r}")
        self._stats, self.interval, self._clock = stats, interval, clock
        self._last: tuple[float, dict] | None = None

    def line(self) -> str | None:
        """The line for the time since the last call (None: the first call, or nothing happened since)."""
        now, s = self._clock(), _as_dict(self._stats())
        last, self._last = self._last, (now, s)
        if last is None:
            return None
        t0, p = last
        dt = max(now - t0, 1e-9)
        prompt = s.get("request_prompt_tokens", 0) - p.get("request_prompt_tokens", 0)
        gen = s.get("generation_tokens", 0) - p.get("generation_tokens", 0)
        busy = s.get("num_running", 0) or s.get("num_waiting", 0) or p.get("num_running", 0)
        if not (prompt or gen or busy):
            return None
        queries = s.get("prefix_cache_queries", 0) - p.get("prefix_cache_queries", 0)
        hits = s.get("prefix_cache_hits", 0) - p.get("prefix_cache_hits", 0)
        cap = s.get("kv_capacity_per_rank") or 0
        kv = ", ".join(f"{100 * u / cap:.1f}%" if cap else "n/a" for u in s.get("kv_tokens_per_rank") or [])
        rate = f"{100 * hits / queries:.1f}%" if queries else "n/a"
        text = (f"prompt throughput {prompt / dt:.1f} tokens/s, generation throughput {gen / dt:.1f} tokens/s, "
                f"running {s.get('num_running', 0)} reqs, waiting {s.get('num_waiting', 0)} reqs, "
                f"KV cache usage per rank [{kv}], prefix cache hit rate {rate}")
        sp, pp = s.get("spec") or {}, p.get("spec") or {}
        drafts = sp.get("num_drafts", 0) - pp.get("num_drafts", 0)
        if drafts:  # speculating: acceptance over the interval
            drafted = sp["num_draft_tokens"] - pp.get("num_draft_tokens", 0)
            accepted = sp["num_accepted_tokens"] - pp.get("num_accepted_tokens", 0)
            text += (f", speculative acceptance {100 * accepted / max(drafted, 1):.1f}% ({accepted}/{drafted} "
                     f"drafted tokens), mean accepted length {accepted / drafts:.2f}")
        return text

    def run(self, stop: threading.Event) -> None:
        """Log a line every interval until `stop` is set (a thread's target)."""
        self.line()
        while not stop.wait(self.interval):
            try:
                text = self.line()
            except Exception:  # noqa: BLE001 - a dead engine: /health and the watcher report it
                continue
            if text:
                log.info("%s", text)
