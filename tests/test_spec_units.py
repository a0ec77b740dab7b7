"""Speculative decoding without ranks: the config's parsing, prompt lookup against a brute-force search, the KV
manager's rollback of rejected drafts (random reserve / verify / truncate / release sequences keep every count and
block reference exact), the adaptive rule, and the acceptance rule's exactness (greedy: the argmax path; sampling:
a fixed-seed chi-square test of the first two emitted tokens on a tiny vocabulary)."""
import dataclasses

import numpy as np
import pytest
import torch

from cpinfer.engine.kv.manager import KVManager
from cpinfer.engine.kv.placement import Placer
from cpinfer.engine.request import Request, RequestStatus
from cpinfer.engine.sampling import SampleSpec, SamplingParams, sample
from cpinfer.engine.scheduler import Scheduler, SchedulerConfig
from cpinfer.engine.spec_decode import adaptive
from cpinfer.engine.spec_decode.config import SpeculativeConfig
from cpinfer.engine.spec_decode.ngram import ngram_draft
from cpinfer.engine.spec_decode.registry import check_method, make_proposer
from cpinfer.engine.spec_decode.rejection import row_specs, verify


# ---------------------------------------------------------------- config
def test_config_parses_vllm_keys_and_refuses_unknown_ones():
    c = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2,
                                 "prompt_lookup_max": 3})
    assert (c.method, c.num_speculative_tokens, c.prompt_lookup_min, c.prompt_lookup_max) == ("ngram", 4, 2, 3)
    assert SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 2}').prompt_lookup_max == 5
    d = SpeculativeConfig.parse({"model": "/some/draft", "num_speculative_tokens": 3})
    assert d.method == "draft_model" and d.model == "/some/draft"
    assert SpeculativeConfig.parse(None) is None
    for bad, words in [({"method": "eagle", "num_speculative_tokens": 2}, "'ngram', 'draft_model'"),
                       ({"method": "ngram", "num_speculative_tokens": 2, "lookahead": 1}, "'lookahead'"),
                       ({"method": "ngram"}, "num_speculative_tokens"),
                       ({"method": "ngram", "num_speculative_tokens": 0}, ">= 1"),
                       ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4,
                         "prompt_lookup_max": 2}, "prompt_lookup_min"),
                       ({"num_speculative_tokens": 2}, "'method'"),
                       ("{not json", "JSON"), (3, "dict")]:
        with pytest.raises(ValueError, match=words.replace("(", r"\(").replace("'", "'")):
            SpeculativeConfig.parse(bad)


def test_registry_builds_ngram_and_names_what_is_missing():
    c = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 2})
    assert make_proposer(c).propose([Request("a", [1, 2, 3, 1, 2], SamplingParams(), 0)], [2])[0].tolist() == [3, 1]
    from cpinfer.engine.spec_decode.registry import PROPOSERS
    if "draft_model" not in PROPOSERS:
        with pytest.raises(ValueError, match="not available"):
            check_method(SpeculativeConfig.parse({"model": "x", "num_speculative_tokens": 2}))


# ---------------------------------------------------------------- prompt lookup
def _brute(tokens, k, lo, hi):
    L = len(tokens)
    for n in range(min(hi, L - 1), lo - 1, -1):
        suffix = tokens[L - n:]
        for j in range(L - 2, n - 2, -1):  # match ends j < L-1, latest first
            if j - n + 1 >= 0 and list(tokens[j - n + 1:j + 1]) == list(suffix):
                return list(tokens[j + 1:j + 1 + k])
    return []


@pytest.mark.parametrize("seed", range(40))
def test_ngram_draft_equals_a_brute_force_search(seed):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 4 if seed % 2 else 9, size=int(rng.integers(1, 60)))
    lo = int(rng.integers(1, 4))
    hi = lo + int(rng.integers(0, 4))
    k = int(rng.integers(1, 6))
    assert ngram_draft(tokens, k, lo, hi).tolist() == _brute(tokens, k, lo, hi)


def test_ngram_draft_is_cheap_on_a_long_context():
    import time
    tokens = np.random.default_rng(0).integers(0, 50000, size=20000)
    tokens[-8:] = tokens[1000:1008]
    t0 = time.process_time()  # this process's CPU time: the draft's cost, not the wait for a core on a busy machine
    for _ in range(10):
        d = ngram_draft(tokens, 5, 2, 5)
    assert d.tolist() == tokens[1008:1013].tolist()
    assert (time.process_time() - t0) / 10 < 0.01


# ---------------------------------------------------------------- KV rollback
@pytest.mark.parametrize("n,mode,seed", [(1, "shard", 0), (2, "shard", 1), (2, "local", 2), (3, "shard", 3),
                                         (3, "local", 4), (2, "shard", 5), (3, "local", 6), (1, "local", 7)])
def test_truncate_keeps_the_cache_consistent(n, mode, seed):
    """Requests (some sharing prefixes) prefill, then decode with random drafts of random acceptance: after every
    step the rejected tail is truncated, and the whole cache is recounted from the tree; drafts are never matched
    by a request admitted in the same step; finished requests keep only verified tokens."""
    rng = np.random.default_rng(seed)
    kv = KVManager(n, 64 * 12, placer=Placer(mode, n))
    sched = Scheduler(kv, SchedulerConfig(48, 6))
    live, ids = {}, 0
    base = rng.integers(3, 40, size=70).tolist()
    for step in range(160):
        if rng.random() < 0.3 and len(live) < 8:
            prompt = (base[:int(rng.integers(5, 70))] if rng.random() < 0.5 else []) + \
                rng.integers(3, 40, size=int(rng.integers(1, 40))).tolist()
            req = Request(f"r{ids}", prompt, SamplingParams(max_tokens=int(rng.integers(1, 30))), 0)
            ids += 1
            live[req.request_id] = req
            sched.add(req)
        for req in sched.running:
            left = req.params.max_tokens - len(req.out) - 1
            req.draft = rng.integers(3, 40, size=int(rng.integers(0, 5)))[:max(0, left)] if not req.is_prefill \
                else None
        scheduled = sched.schedule()
        for s in scheduled:
            if s.draft is not None:
                assert len(set(s.placement.ranks.tolist())) == 1 and s.sample and s.is_decode
                assert s.request.kv.leaf.unverified == len(s.draft)
        for s in scheduled:
            req = s.request
            req.draft = None
            if not s.sample:
                continue
            k = 0 if s.draft is None else len(s.draft)
            m = int(rng.integers(0, k + 1))
            emitted = (list(s.draft[:m]) if k else []) + [int(rng.integers(3, 40))]
            for t in emitted:
                req.out.append(t)
                if len(req.out) >= req.params.max_tokens:
                    break
            kv.truncate(req.kv, min(req.kv.num_stored, len(req.known) - 1))
            assert req.kv.num_stored == len(req.known) - 1
            assert req.kv.leaf.unverified == 0
            path, node = [], req.kv.leaf
            while node is not kv.root:
                path.append(node.tokens.view)
                node = node.parent
            assert np.concatenate(path[::-1]).tolist() == req.known[:-1]
            if len(req.out) >= req.params.max_tokens:
                sched.finish(req, keep_cache=True)
                del live[req.request_id]
        kv.check_invariants()
        for req in live.values():
            if req.status is RequestStatus.RUNNING:
                flat = np.sort(np.concatenate([r * 10**9 + np.concatenate([np.arange(a, e) for a, e in rr] or [[]])
                                               for r, rr in enumerate(req.kv.runs)]).astype(np.int64))
                assert len(flat) == req.num_stored
                np.testing.assert_array_equal(np.bincount(flat // 10**9, minlength=n), req.kv.per_rank)
    for req in list(live.values()):
        sched.finish(req, keep_cache=False)
    kv.check_invariants()
    assert ids > 5


# ---------------------------------------------------------------- adaptive
def test_adaptive_rule_shrinks_pauses_and_recovers():
    st = adaptive.SpecState(k_max=6)
    assert st.next_k() >= 4  # optimistic prior
    for _ in range(12):
        st.record(4, 0, 1)
    assert st.next_k() == 0 and st.pause > 0  # no gain: it decodes plainly for a while
    ks = [st.next_k() for _ in range(adaptive.PAUSE_FIRST)]
    assert ks[-1] == 1 and not any(ks[:-1])  # then probes with one draft
    for _ in range(20):
        st.record(1, 1, 2)
    assert st.next_k() == 6
    assert adaptive.best_k(0.0, 6)[1] < 1.0 < adaptive.best_k(0.5, 6)[1]
    m = st.metrics()
    assert m["num_drafts"] == 32 and m["num_accepted_tokens"] == 20 and m["num_draft_tokens"] == 68


def test_engine_requests_draft_among_the_captured_sizes():
    """An engine request's k is one of `draft_sizes` (the static decode path's captured verify widths minus one),
    whatever its acceptance; the size of the largest gain among them."""
    assert adaptive.draft_sizes(1) == (1,) and adaptive.draft_sizes(4) == (1, 2, 4)
    assert adaptive.draft_sizes(8) == (1, 2, 4, 8) and adaptive.draft_sizes(6) == (1, 2, 4, 6)
    assert adaptive.verify_widths(6) == (2, 3, 5, 7)
    for a in np.linspace(0.05, 0.99, 25):
        k, gain = adaptive.best_k(float(a), 6, sizes=adaptive.draft_sizes(6))
        assert k in (1, 2, 4, 6)
        assert gain == max(adaptive.expected_tokens(float(a), j) / (1 + adaptive.VERIFY_TOKEN_COST * j)
                           for j in (1, 2, 4, 6))
    st = adaptive.SpecState.of(6)
    seen = set()
    for accepted in [3, 0, 0, 1, 2, 0, 0, 0, 0, 4, 4, 4, 4, 4, 4] * 3:
        k = st.next_k()
        seen.add(k)
        if k:
            st.record(k, min(k, accepted), min(k, accepted) + 1)
    assert seen <= {0, 1, 2, 4, 6} and len(seen - {0}) >= 2, seen


# ---------------------------------------------------------------- acceptance rule
V = 5


def _spec(seed, step=0, temperature=1.0, **kw):
    return SampleSpec.of(SamplingParams(temperature=temperature, **kw), seed, step)


def test_greedy_verify_is_plain_greedy_row_by_row():
    torch.manual_seed(0)
    for trial in range(50):
        logits = torch.randn(4, 11)
        argmax = logits.argmax(-1).tolist()
        draft = np.asarray([argmax[0], argmax[1] if trial % 2 else (argmax[1] + 1) % 11, argmax[2]])
        spec = _spec(trial, temperature=0.0, top_logprobs=2)
        out = verify(logits, draft, row_specs(spec, draft))
        want = [sample(logits[i], s) for i, s in enumerate(row_specs(spec, draft))]
        m = 3 if trial % 2 else 1
        assert [t for t, *_ in out] == [t for t, *_ in want[:m + 1]]
        for (t, lp, top), (t2, lp2, top2) in zip(out, want):
            assert lp == lp2 and top == top2


def test_row_specs_read_the_drafts_as_output():
    spec = SampleSpec.of(SamplingParams(temperature=0.0, frequency_penalty=2.0, min_tokens=3), 1, 5,
                         suppress=(4,), output=np.asarray([1, 2]))
    rows = row_specs(spec, np.asarray([7, 8]), suppress_rows=1)
    assert [r.step for r in rows] == [5, 6, 7]
    assert [r.output.tolist() for r in rows] == [[1, 2], [1, 2, 7], [1, 2, 7, 8]]
    assert [r.suppress for r in rows] == [(4,), (), ()]
    logits = torch.zeros(3, 10)
    logits[:, 7] = 3.0  # the penalty of the drafted 7 makes row 1 pick another token
    logits[:, 8] = 2.5
    out = verify(logits, np.asarray([7, 8]), rows)
    assert [t for t, *_ in out] == [7, 8, 7]  # row 2 reads 7 and 8 as output: 7 again (bonus)


def _chi2_threshold(df: int) -> float:
    """The chi-square quantile of false-alarm rate 1e-3 (scipy when installed; else the Wilson-Hilferty
    approximation, within 1% of the table value at these degrees of freedom)."""
    try:
        from scipy.stats import chi2
        return float(chi2.ppf(1 - 1e-3, df))
    except ImportError:
        z = 3.090232  # the standard normal's 0.999 quantile
        return df * (1 - 2 / (9 * df) + z * (2 / (9 * df)) ** 0.5) ** 3


@pytest.mark.parametrize("proposal", ["point", "q"])
def test_sampling_keeps_the_target_distribution_of_the_first_two_tokens(proposal):
    """A tiny bigram 'model' on 5 tokens (target logits T[prev], draft distribution Q[prev]) with temperature and
    top-k: speculation with k=2 drafts emits (x1, x2) with the target's joint p(x1 | c) p(x2 | x1). 10,000 seeded
    requests; chi-square over the 25 cells against the 1e-3 false-alarm threshold (deterministic: fixed seeds)."""
    g = torch.Generator().manual_seed(7)
    target = torch.randn(V, V, generator=g) * 1.5  # [prev, V] logits
    qprobs = torch.softmax(torch.randn(V, V, generator=g), -1)  # [prev, V] the draft's distribution
    params = dict(temperature=0.8, top_k=4)
    c = 2
    counts = np.zeros((V, V))
    rng = np.random.default_rng(11)
    n_samples = 10000
    for seed in range(n_samples):
        ctx, out = c, []
        while len(out) < 2:
            if proposal == "point":  # deterministic drafts from the context (prompt lookup's case)
                d = np.asarray([(ctx + 1) % V, (ctx + 3) % V])
                q = None
            else:
                d1 = int(rng.choice(V, p=qprobs[ctx].numpy() / qprobs[ctx].numpy().sum()))
                d2 = int(rng.choice(V, p=qprobs[d1].numpy() / qprobs[d1].numpy().sum()))
                d, q = np.asarray([d1, d2]), torch.stack([qprobs[ctx], qprobs[d1]])
            logits = target[[ctx, int(d[0]), int(d[1])]]
            spec = _spec(seed, step=len(out), **params)
            emitted = verify(logits, d, row_specs(spec, d), q)
            out += [t for t, *_ in emitted]
            ctx = out[-1]
        counts[out[0], out[1]] += 1
    from cpinfer.engine.sampling import target_probs
    p = [target_probs(target[i].clone(), _spec(0, **params)) for i in range(V)]
    joint = torch.outer(p[c], torch.ones(V)) * torch.stack(p)  # [x1, x2] = p(x1|c) p(x2|x1)
    expected = joint.numpy() * n_samples
    cells = expected > 0
    assert counts[~cells].sum() == 0  # nothing outside the target's support (top-k cut)
    stat = float((((counts - expected) ** 2)[cells] / expected[cells]).sum())
    df = int(cells.sum()) - 1
    threshold = _chi2_threshold(df)
    print(f"chi-square {proposal}: {stat:.2f} over {df} degrees of freedom, threshold {threshold:.2f}")
    assert stat < threshold


# ---------------------------------------------------------------- metrics and flags
def test_metrics_and_stats_line_report_speculation():
    from prometheus_client import CollectorRegistry, generate_latest

    from cpinfer.server.metrics import EngineCollector, StatsLogger

    spec = {"num_drafts": 10, "num_draft_tokens": 40, "num_accepted_tokens": 25, "num_emitted_tokens": 35,
            "accepted_per_pos": [9, 8, 5, 3], "acceptance_rate": 0.625, "mean_accepted_length": 2.5,
            "verify_fallbacks": 3}
    state = {"generation_tokens": 0, "spec": {}}
    reg = CollectorRegistry()
    reg.register(EngineCollector(lambda: state, lambda: False, "m"))
    assert b"spec_decode" not in generate_latest(reg)  # not speculating: no series
    state.update(generation_tokens=35, spec=spec)
    text = generate_latest(reg).decode()
    for line in ['vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 10.0',
                 'vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 40.0',
                 'vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 25.0',
                 'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="2"} 5.0',
                 'cpinfer_spec_decode_num_emitted_tokens_total{engine="0",model_name="m"} 35.0',
                 'cpinfer_spec_decode_acceptance_rate{engine="0",model_name="m"} 0.625',
                 'cpinfer_spec_decode_mean_accepted_length{engine="0",model_name="m"} 2.5',
                 'cpinfer_spec_decode_verify_fallbacks_total{engine="0",model_name="m"} 3.0']:
        assert line in text, line
    t = [0.0]
    state.update(generation_tokens=0, spec={})
    logger = StatsLogger(lambda: state, 1.0, clock=lambda: t[0])
    logger.line()
    t[0] = 1.0
    state.update(generation_tokens=35, spec=spec)
    assert "speculative acceptance 62.5% (25/40 drafted tokens), mean accepted length 2.50" in logger.line()


def test_speculative_config_flag_is_checked_on_the_command_line():
    import argparse

    from cpinfer.commands.model_args import add_speculative_argument

    parser = argparse.ArgumentParser()
    add_speculative_argument(parser)
    args = parser.parse_args(["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}'])
    assert args.speculative_config.num_speculative_tokens == 3
    assert parser.parse_args([]).speculative_config is None
    with pytest.raises(SystemExit):
        parser.parse_args(["--speculative-config", '{"method": "ngram", "k": 3}'])


def test_step_cost_reads_the_row_share_of_decode_forwards():
    cost = adaptive.StepCost()
    assert cost.row_share(1) == adaptive.VERIFY_TOKEN_COST  # nothing measured yet
    for i in range(40):  # 50 ms per forward + 25 ms per row
        rows = 1 + i % 5
        cost.add(rows, 0.05 + 0.025 * rows)
    assert cost.row_share(1) == pytest.approx(0.025 / 0.075)
    assert cost.row_share(4) == pytest.approx(0.025 / 0.15)
    # at that cost, a request accepting half its drafts gains nothing by speculating: it pauses
    st = adaptive.SpecState(k_max=4, acceptance=0.3)
    assert st.next_k(cost.row_share(1)) == 0 and st.pause > 0
    assert adaptive.SpecState(k_max=4, acceptance=0.95).next_k(cost.row_share(1)) >= 3


def test_draft_q_reaches_the_acceptance_rule():
    """A proposer's q rows reach the rank's acceptance rule, shipped with the batch (SeqInput.draft_q) or left on the
    rank (draft_probs[draft_key]): a draft the target gives ~0 is rejected and the target's token emitted; one it
    gives ~1 is kept and followed by the bonus token."""
    from cpinfer.engine.batch import ForwardBatch, SeqInput
    from cpinfer.engine.model_runner import ModelRunner

    logits = torch.full((2, V), -30.0)
    logits[:, 1] = 0.0  # the target puts everything on token 1
    spec = _spec(3)
    seq = SeqInput(np.asarray([0, 4]), 0, np.zeros(2, np.int64), np.arange(2), (), spec,
                   draft=np.asarray([4]), draft_key="r", draft_q=np.eye(V, dtype=np.float32)[[4]])
    batch = ForwardBatch((seq,), "local", "decode")
    (res,) = ModelRunner._draw(batch, [0], logits)
    assert res.error is None and res.extra == () and res.token == 1
    seq1 = dataclasses.replace(seq, draft=np.asarray([1]), draft_q=None)
    (res,) = ModelRunner._draw(ForwardBatch((seq1,), "local", "decode"), [0], logits, {"r": torch.eye(V)[[1]]})
    assert [t for t, *_ in res.extra] == [1] and res.token == 1


def test_spec_verify_is_checked_before_any_rank_starts():
    """`spec_verify`: "decode" (the default) or "prefill"; anything else is refused by name with the allowed values."""
    from cpinfer.engine.config import EngineConfig

    assert EngineConfig().spec_verify == "decode" and EngineConfig(spec_verify="prefill").spec_verify == "prefill"
    with pytest.raises(ValueError, match="spec_verify must be one of 'decode', 'prefill', got 'graph'"):
        EngineConfig(spec_verify="graph")
