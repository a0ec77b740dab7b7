"""The draft model of speculative decoding: its K/V mirror the target's slots on every CP rank, its k draft-only
steps (through the engine's attention machinery, the ring for a spread request) give the draft model's own greedy
continuation, and a draft that cannot serve the target is refused before any rank starts."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from cpinfer.engine.sampling import SamplingParams
from cpinfer.engine.spec_decode import draft_runner as DR
from cpinfer.engine.spec_decode.draft import DraftProposer, check_draft, verify_rank
from cpinfer.model import ModelConfig, load_model
from pooled_engine import shard_engines

GREEDY = SamplingParams(max_tokens=14, ignore_eos=True, temperature=0.0, logprobs=True)
K = 4


@pytest.fixture(scope="module")
def engines():
    yield from shard_engines()


@pytest.fixture(scope="module")
def target(llama_checkpoint):
    return llama_checkpoint("gqa", max_position_embeddings=1024)


@pytest.fixture(scope="module")
def small_draft(llama_checkpoint):
    """A different, smaller model with the target's vocabulary (one layer, 4 query heads on 1 KV head)."""
    return llama_checkpoint("mqa", seed=7, num_hidden_layers=1, max_position_embeddings=1024)


def _reference(path, tokens: list[int], steps: int = 0) -> tuple[torch.Tensor, list[int], torch.Tensor]:
    """A fresh single-device forward of `tokens` on the model at `path` (plain causal SDPA): its keys
    [layers, T, Hkv, D], its greedy continuation of `steps` tokens and the logits [V] after `tokens`."""
    config, model = load_model(path)
    keys: list[torch.Tensor] = []

    def attn(layer, q, k, v, sinks=None, expand=None):  # q [T, H, D], k / v [T, Hkv, D]
        keys.append(k.clone())
        rep = q.shape[1] // k.shape[1]
        o = F.scaled_dot_product_attention(q.transpose(0, 1), k.repeat_interleave(rep, 1).transpose(0, 1),
                                           v.repeat_interleave(rep, 1).transpose(0, 1), is_causal=True,
                                           scale=config.attention_scale)
        return o.transpose(0, 1)  # [T, H, D]

    seq, first, after = list(tokens), None, None
    with torch.inference_mode():
        for i in range(steps + 1):
            keys.clear()
            hidden = model(torch.tensor(seq), torch.arange(len(seq)), attn)
            logits = model.compute_logits(hidden[-1:])[0]  # [V]
            first = torch.stack(keys) if first is None else first
            after = logits if after is None else after
            if i < steps:
                seq.append(int(torch.argmax(logits)))
    return first, seq[len(tokens):], after


def _path_slots(kv) -> tuple[np.ndarray, np.ndarray]:
    """(rank [T], slot [T]) of positions 0 .. T-1 of a running request's path in the prefix tree."""
    nodes, node = [], kv.leaf
    while node is not None and node.parent is not None:
        nodes.append(node)
        node = node.parent
    nodes.reverse()
    return (np.concatenate([n.rank.view for n in nodes]).astype(np.int64),
            np.concatenate([n.slot.view for n in nodes]).astype(np.int64))


def _rows(engine, ranks: np.ndarray, slots: np.ndarray, which: str) -> torch.Tensor:
    """The K rows [layers, T, Hkv, D] of `which` store ("draft" or "target") at (ranks, slots), in that order."""
    per_rank = engine._pool.run(DR.store_rows, None, which)  # [layers, capacity + 1(+ scratch), Hkv, D] per rank
    return torch.stack([per_rank[r][:, s] for r, s in zip(ranks.tolist(), slots.tolist())], dim=1)


def _spec(path) -> dict:
    return {"model": str(path), "num_speculative_tokens": K}


def _run_with_draft(llm, prompt, check_at=(1, 6)):
    """Generate `prompt` greedily step by step with a draft model loaded; at the given output lengths compare the
    stores and propose K drafts. Returns (output RequestOutput, [(output length, context, drafts, draft rows,
    target rows, path)])."""
    eng = llm.engine
    proposer = DraftProposer(eng.args.speculative_config, eng)
    eng.add_request("r", prompt, GREEDY)
    seen, final = [], None
    while eng.has_unfinished_requests():
        req = eng.requests.get("r")
        if req is not None and req.num_to_compute == 1 and len(req.out) in check_at:
            ranks, slots = _path_slots(req.kv)
            drafts = proposer.propose([req], [K])[0]
            seen.append((len(req.out), req.known[:len(slots)], drafts, _rows(eng, ranks, slots, "draft"),
                         _rows(eng, ranks, slots, "target"), req.kv))
            check_at = tuple(n for n in check_at if n != len(req.out))
        for out in eng.step():
            final = out if out.finished else final
    return final, seen


@pytest.mark.parametrize("cp", [1, 2])
def test_draft_equal_to_target_drafts_the_target_continuation(engines, target, cp):
    prompt = np.random.default_rng(cp).integers(3, 256, 45).tolist()
    ref = engines(target, cp, max_kv_tokens_per_rank=1024).generate([prompt], GREEDY)[0]
    out, seen = _run_with_draft(engines(target, cp, max_kv_tokens_per_rank=1024, speculative_config=_spec(target)),
                                prompt)
    assert out.token_ids == ref.token_ids  # proposing disturbs nothing of the target
    np.testing.assert_allclose(out.logprobs, ref.logprobs, atol=1e-4)
    assert len(seen) == 2
    for n, _, drafts, draft_rows, target_rows, kv in seen:
        # a draft equal to the target accepts every token: its drafts are the target's next K greedy tokens
        assert drafts.tolist() == ref.token_ids[n:n + K]
        # same model: the same K rows, up to rounding (rows drafted in decode steps move to their slots)
        torch.testing.assert_close(draft_rows, target_rows, atol=1e-5, rtol=1e-5)
    if cp > 1:
        assert seen[-1][-1].home < 0  # spread over both ranks: the draft steps went through the ring


@pytest.mark.parametrize("cp", [1, 2])
def test_smaller_draft_mirrors_and_drafts_its_own_greedy(engines, target, small_draft, cp):
    prompt = np.random.default_rng(10 + cp).integers(3, 256, 38).tolist()
    ref = engines(target, cp, max_kv_tokens_per_rank=1024).generate([prompt], GREEDY)[0]
    out, seen = _run_with_draft(engines(target, cp, max_kv_tokens_per_rank=1024,
                                        speculative_config=_spec(small_draft)), prompt)
    assert out.token_ids == ref.token_ids
    np.testing.assert_allclose(out.logprobs, ref.logprobs, atol=1e-4)
    for n, context, drafts, draft_rows, _, _ in seen:
        keys, _, _ = _reference(small_draft, context)  # the draft alone on the committed context
        # the draft's store at the request's slots (every rank) holds what a fresh draft forward computes
        torch.testing.assert_close(draft_rows, keys, atol=1e-5, rtol=1e-5)
        last = prompt + ref.token_ids[:n]
        _, expected, _ = _reference(small_draft, last, K)
        assert drafts.tolist() == expected


def test_vocabulary_and_tensor_parallel_refused(llama_checkpoint, target):
    config = ModelConfig.from_pretrained(target)
    other = llama_checkpoint("gqa", vocab_size=320)
    with pytest.raises(ValueError, match="vocabulary has 320 tokens, the target's 256"):
        check_draft(config, None, other, 1)
    with pytest.raises(ValueError, match="tensor_parallel_size 1 only"):
        check_draft(config, None, target, 2)
    assert check_draft(config, None, target, 1).vocab_size == 256
    from cpinfer.engine.llm import LLM

    for kw, why in (({}, "vocabulary has 320 tokens"), ({"tensor_parallel_size": 2}, "tensor_parallel_size 1 only")):
        with pytest.raises(ValueError, match=why):  # the engine refuses before any rank starts
            LLM(str(target), speculative_config=_spec(other if not kw else target), **kw)


@pytest.mark.parametrize("cp", [1, 2])
def test_sampled_drafts_are_reproducible_and_keep_q_on_the_verifying_rank(engines, target, small_draft, cp):
    llm = engines(target, cp, max_kv_tokens_per_rank=1024, speculative_config=_spec(small_draft))
    eng = llm.engine
    proposer = DraftProposer(eng.args.speculative_config, eng)
    params = SamplingParams(max_tokens=8, ignore_eos=True, temperature=0.8, top_k=40, seed=123)
    eng.add_request("s", np.random.default_rng(5).integers(3, 256, 41).tolist(), params)
    while not (eng.requests["s"].out and eng.requests["s"].num_to_compute == 1):
        eng.step()
    req = eng.requests["s"]
    first = proposer.propose([req], [K])[0]
    q_first = eng._pool.run(DR.take_q, "s")
    again = proposer.propose([req], [K])[0]
    q_again = eng._pool.run(DR.take_q, "s")
    assert len(first) == K and first.tolist() == again.tolist()  # seeded: the same drafts from the same state
    held = [r for r, q in enumerate(q_first) if q is not None]
    assert held == [verify_rank(eng.kv, req.kv)]  # kept where the verification will run, nowhere else
    q, q2 = q_first[held[0]], q_again[held[0]]
    torch.testing.assert_close(q, q2, atol=0, rtol=0)
    assert q.shape == (K, 256)
    torch.testing.assert_close(q.sum(-1), torch.ones(K), atol=1e-5, rtol=0)
    assert all(float(q[i, d]) > 0 for i, d in enumerate(first.tolist()))  # each draft was drawn from its q row
    assert all(int((q[i] > 0).sum()) <= 40 for i in range(K))  # the request's top-k applied to the draft's q
    # q's first row is the draft model's processed distribution after the committed tokens
    _, _, logits = _reference(small_draft, req.known)
    torch.testing.assert_close(q[0], DR.draft_probs(logits, eng._sample_spec(req)), atol=1e-5, rtol=1e-4)
    eng.abort("s")
    while eng.has_unfinished_requests():
        eng.step()


def test_gguf_draft_resolved_and_tokenizer_mismatch_refused(llama_checkpoint, tmp_path):
    import json
    import shutil

    from checkpoints import GGUF_TEST_VOCAB, write_gguf_from_hf
    from transformers import AutoTokenizer

    from cpinfer.engine.spec_decode.draft import resolve_draft

    hf = llama_checkpoint("gqa", vocab_size=GGUF_TEST_VOCAB["bpe"])
    config = ModelConfig.from_pretrained(hf)
    path, draft = resolve_draft(str(write_gguf_from_hf(hf, tmp_path / "draft.gguf")), config, None, 1)
    assert draft.vocab_size == config.vocab_size and (tmp_path / "draft.gguf").exists()
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert check_draft(config, tokenizer, path, 1).vocab_size == config.vocab_size  # its own tokenizer: the same
    other = tmp_path / "renamed"
    shutil.copytree(path, other)
    tok = json.loads((other / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    name = next(t for t, i in vocab.items() if i == 100)
    vocab["zz-renamed"] = vocab.pop(name)  # the same size, one token spelled differently
    (other / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(ValueError, match="tokenizer differs from the target's"):
        check_draft(config, tokenizer, other, 1)


def test_draft_memory_on_a_gpu_is_counted_before_the_kv_cache_is_sized(small_draft):
    """On CUDA the KV cache is sized from memory before the draft loads: the sizing takes off its weights (counted
    from the safetensors headers: the model's own parameter count), its scratch rows, and its store's bytes per slot."""
    from types import SimpleNamespace

    from transformers import AutoModelForCausalLM

    from cpinfer.engine.spec_decode.draft import draft_reserve_bytes, draft_token_bytes, draft_weight_bytes

    config = ModelConfig.from_pretrained(small_draft)
    params = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(small_draft).parameters())
    assert draft_weight_bytes((small_draft, config), 2) == 2 * params
    per_slot = draft_token_bytes((small_draft, config), 2)
    assert per_slot == 2 * config.num_hidden_layers * config.cached_kv_heads * 2 * config.head_dim
    args = SimpleNamespace(max_num_seqs=8, speculative_config=SimpleNamespace(num_speculative_tokens=4))
    assert draft_reserve_bytes(args, (small_draft, config), 2) == 2 * params + (8 * 4 + 1) * per_slot
    assert draft_reserve_bytes(args, None, 2) == draft_weight_bytes(None, 2) == draft_token_bytes(None, 2) == 0


# ---------------------------------------------------------------- the engine speculating with a draft model

def _prompts(seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 256, n).tolist() for n in (29, 45, 61)]


@pytest.mark.parametrize("cp", [1, 2, 3])
def test_engine_with_draft_equal_to_target_accepts_every_token(engines, target, cp):
    prompts = _prompts(20 + cp)
    ref = engines(target, cp, max_kv_tokens_per_rank=1024).generate(prompts, GREEDY)
    llm = engines(target, cp, max_kv_tokens_per_rank=1024, speculative_config=_spec(target))
    outs = llm.generate(prompts, GREEDY)
    for o, r in zip(outs, ref):
        assert o.token_ids == r.token_ids
        np.testing.assert_allclose(o.logprobs, r.logprobs, atol=1e-4)
    spec = llm.engine.stats().spec
    assert spec["num_draft_tokens"] > 0
    assert spec["num_accepted_tokens"] == spec["num_draft_tokens"]  # acceptance rate exactly 1
    # again, from the prefix cache: the draft's K/V of the cached prefixes sit at the target's slots
    again = llm.generate([p + o.token_ids[:5] for p, o in zip(prompts, ref)], GREEDY)
    assert all(o.num_cached_tokens > 0 for o in again)
    spec2 = llm.engine.stats().spec
    assert spec2["num_draft_tokens"] > spec["num_draft_tokens"]
    assert spec2["num_accepted_tokens"] == spec2["num_draft_tokens"]
    plain = engines(target, cp, max_kv_tokens_per_rank=1024).generate([p + o.token_ids[:5] for p, o in
                                                                       zip(prompts, ref)], GREEDY)
    assert [o.token_ids for o in again] == [o.token_ids for o in plain]


def test_engine_with_draft_preempted_mid_speculation(engines, target, small_draft):
    prompts = _prompts(60)
    params = SamplingParams(max_tokens=40, ignore_eos=True, temperature=0.0, logprobs=True)
    ref = engines(target, 1, max_kv_tokens_per_rank=1024).generate(prompts, params)
    llm = engines(target, 1, max_kv_tokens_per_rank=256, speculative_config=_spec(small_draft))
    outs = llm.generate(prompts, params)
    assert llm.engine.scheduler.num_preemptions > 0  # recomputed requests: the mirror rewrites their draft K/V
    for o, r in zip(outs, ref):
        assert o.token_ids == r.token_ids
        np.testing.assert_allclose(o.logprobs, r.logprobs, atol=1e-4)


@pytest.mark.parametrize("cp", [1, 2])
def test_engine_with_smaller_draft_equals_plain_greedy(engines, target, small_draft, cp):
    prompts = _prompts(30 + cp)
    ref = engines(target, cp, max_kv_tokens_per_rank=1024).generate(prompts, GREEDY)
    llm = engines(target, cp, max_kv_tokens_per_rank=1024, speculative_config=_spec(small_draft))
    outs = llm.generate(prompts, GREEDY)
    for o, r in zip(outs, ref):
        assert o.token_ids == r.token_ids
        np.testing.assert_allclose(o.logprobs, r.logprobs, atol=1e-4)
    spec = llm.engine.stats().spec
    assert spec["num_draft_tokens"] > 0 and spec["num_accepted_tokens"] < spec["num_draft_tokens"]


@pytest.mark.parametrize("cp", [1, 2])
def test_engine_seeded_sampling_with_draft_is_reproducible(engines, target, small_draft, cp):
    prompts = _prompts(40 + cp)
    params = SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.9, top_p=0.95, seed=11)
    runs = []
    for _ in range(2):
        llm = engines(target, cp, max_kv_tokens_per_rank=1024, speculative_config=_spec(small_draft))
        runs.append([o.token_ids for o in llm.generate(prompts, params)])
        assert llm.engine.stats().spec["num_draft_tokens"] > 0
    assert runs[0] == runs[1]


def _draft_of(ctx):
    return ctx.state["draft"]


def test_q_missing_on_the_verifying_rank_comes_from_the_mirror(engines, target, small_draft):
    """A sampled verification on a rank that holds no q rows (drafted elsewhere) takes them from the draft's mirror
    of the verify forward: the same distributions (up to rounding), hence the same tokens."""
    prompts = _prompts(50)
    params = SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.9, top_k=50, seed=5)
    llm = engines(target, 1, max_kv_tokens_per_rank=1024, speculative_config=_spec(small_draft))
    draft, reused = llm.engine._pool.run(_draft_of)[0], []
    reuse = draft._reuse_drafted

    def counted_reuse(s):  # verify sequences whose drafted rows move to their slots (not recomputed)
        out = reuse(s)
        reused.append(out is not s)
        return out

    draft._reuse_drafted = counted_reuse
    expected = [o.token_ids for o in llm.generate(prompts, params)]
    assert sum(reused) >= 3
    llm = engines(target, 1, max_kv_tokens_per_rank=1024, speculative_config=_spec(small_draft))
    draft = llm.engine._pool.run(_draft_of)[0]  # rank 0 runs in this process
    proposed, pairs = {}, []
    propose, mirror = draft.propose, draft.mirror

    def forgetful_propose(seqs):  # as if every request had been drafted on another rank
        out = propose(seqs)
        proposed.update(draft.q)
        draft.q.clear()
        draft.proposed = {}  # nor its draft rows here to reuse
        return out

    def watched_mirror(batch):
        mirror(batch)
        pairs.extend((proposed.pop(s.draft_key), draft.q[s.draft_key].clone())
                     for s in batch.seqs if s.draft is not None and len(s.draft))

    draft.propose, draft.mirror = forgetful_propose, watched_mirror
    assert [o.token_ids for o in llm.generate(prompts, params)] == expected
    assert len(pairs) >= 3
    for q, again in pairs:
        torch.testing.assert_close(again, q, atol=1e-5, rtol=1e-4)


def test_a_draft_whose_constraints_allow_nothing_stops_alone(engines, target, small_draft):
    import dataclasses

    from cpinfer.engine.spec_decode.draft import verify_rank

    llm = engines(target, 1, max_kv_tokens_per_rank=1024, speculative_config=_spec(small_draft))
    eng = llm.engine
    for rid, seed in (("a", 1), ("b", 2)):
        eng.add_request(rid, np.random.default_rng(seed).integers(3, 256, 33).tolist(), GREEDY)
    while not all(eng.requests[r].out and eng.requests[r].num_to_compute == 1 for r in "ab"):
        eng.step()
    seqs = []
    for rid in "ab":
        req = eng.requests[rid]
        spec = eng._sample_spec(req)
        if rid == "a":
            spec = dataclasses.replace(spec, allowed=np.zeros(8, dtype=np.int32))  # no token allowed
        seqs.append(DR.DraftSeq(rid, req.out[-1], req.kv.num_stored, verify_rank(eng.kv, req.kv),
                                tuple(req.kv.runs_array(r) for r in range(eng.n)), K, spec))
    drafts = eng._pool.run(DR.propose, tuple(seqs))[0]
    assert len(drafts["a"]) == 0 and len(drafts["b"]) == K  # the engine goes on; the other request drafts
    for rid in "ab":
        eng.abort(rid)
    while eng.has_unfinished_requests():
        eng.step()


def test_sampled_drafts_follow_the_q_rows_kept_for_acceptance(engines, target, small_draft):
    """The acceptance rule is exact when each d_i is drawn from the q_i it is given: 2,000 seeded first drafts
    from one context (one propose call per 250 requests) against the kept q_1, chi-square over the top-k cells at
    the 1e-3 false-alarm threshold (fixed seeds: deterministic)."""
    import dataclasses

    from cpinfer.engine.spec_decode.draft import verify_rank

    from test_spec_units import _chi2_threshold

    llm = engines(target, 1, max_kv_tokens_per_rank=1024, speculative_config=_spec(small_draft))
    eng = llm.engine
    params = SamplingParams(max_tokens=8, ignore_eos=True, temperature=1.3, top_k=6, seed=1)
    eng.add_request("c", np.random.default_rng(9).integers(3, 256, 37).tolist(), params)
    while not (eng.requests["c"].out and eng.requests["c"].num_to_compute == 1):
        eng.step()
    req = eng.requests["c"]
    spec = eng._sample_spec(req)
    runs = tuple(req.kv.runs_array(r) for r in range(eng.n))
    rank = verify_rank(eng.kv, req.kv)
    counts, q1 = np.zeros(256), None
    for batch in range(8):
        seqs = tuple(DR.DraftSeq(f"c{batch}-{i}", req.out[-1], req.kv.num_stored, rank, runs, 1,
                                 dataclasses.replace(spec, seed=1000 * batch + i)) for i in range(250))
        drafts = eng._pool.run(DR.propose, seqs)[0]
        q = eng._pool.run(DR.take_q, seqs[0].key)[0][0]  # [V] the same for every seed
        q1 = q if q1 is None else q1
        torch.testing.assert_close(q, q1, atol=0, rtol=0)
        for d in drafts.values():
            counts[int(d[0])] += 1
    expected = q1.double().numpy() * counts.sum()
    cells = expected > 0
    assert int(cells.sum()) == 6 and counts[~cells].sum() == 0  # top-k of the draft: its support, nothing else
    stat = float((((counts - expected) ** 2)[cells] / expected[cells]).sum())
    threshold = _chi2_threshold(int(cells.sum()) - 1)
    print(f"chi-square of the first drafts against q_1: {stat:.2f} over {int(cells.sum()) - 1} degrees of freedom, "
          f"threshold {threshold:.2f}")
    assert stat < threshold
    eng.abort("c")
    while eng.has_unfinished_requests():
        eng.step()


def test_engine_with_draft_host_tier_and_fp8(engines, target, small_draft):
    """Prefixes evicted to the host tier come back without draft K/V (weaker drafts, the same output); an FP8
    target cache with a draft (kept in full precision) gives FP8 plain greedy's output."""
    prompts, other = _prompts(70), _prompts(71)
    ref = engines(target, 2, max_kv_tokens_per_rank=1024).generate(prompts, GREEDY)
    llm = engines(target, 2, max_kv_tokens_per_rank=128, kv_host_gib=0.01, speculative_config=_spec(small_draft))
    first = llm.generate(prompts, GREEDY)
    llm.generate(other, GREEDY)  # pushes the first prompts' cache to the host tier
    again = llm.generate(prompts, GREEDY)
    stats = llm.engine.stats()
    assert stats.tiers["host"]["hit_tokens"] > 0 and stats.spec["num_draft_tokens"] > 0
    for got in (first, again):
        assert [o.token_ids for o in got] == [o.token_ids for o in ref]
        for o, r in zip(got, ref):
            np.testing.assert_allclose(o.logprobs, r.logprobs, atol=1e-4)
    ref8 = engines(target, 2, max_kv_tokens_per_rank=1024, kv_cache_dtype="fp8").generate(prompts, GREEDY)
    llm8 = engines(target, 2, max_kv_tokens_per_rank=1024, kv_cache_dtype="fp8",
                   speculative_config=_spec(small_draft))
    got8 = llm8.generate(prompts, GREEDY)
    assert [o.token_ids for o in got8] == [o.token_ids for o in ref8]
    for o, r in zip(got8, ref8):
        np.testing.assert_allclose(o.logprobs, r.logprobs, atol=1e-4)
    assert llm8.engine.stats().spec["num_draft_tokens"] > 0
