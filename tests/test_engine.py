"""The engine end to end against Hugging Face transformers on tiny random checkpoints (fp32, CPU, gloo)."""
import numpy as np
import pytest
import torch

from cpinfer import LLM, SamplingParams
from hf_oracle import check_against_hf, prompts_for
from pooled_engine import keyed_engines

GREEDY = dict(temperature=0.0, logprobs=True)


@pytest.fixture(scope="module")
def engine():
    """`engine(path, cp, **kw)`: the LLM of (checkpoint, CP, options), reused until another one is asked for on the
    same number of ranks; one pool of ranks per CP size serves the module (tests/pooled_engine.py)."""
    yield from keyed_engines(threads_per_rank=1, timeout_s=120)


@pytest.mark.parametrize("variant", ["gqa", "mqa", "mha", "tied", "llama3"])
@pytest.mark.parametrize("cp", [1, 2, 4])
def test_matches_hf_mixed_batch(llama_checkpoint, engine, variant, cp):
    path = llama_checkpoint(variant, max_position_embeddings=2048)
    llm = engine(path, cp, max_kv_tokens_per_rank=2048, placement="shard")  # every sequence in the ring
    prompts = prompts_for(llm.config.vocab_size, [1, 37, 130], seed=cp)
    params = SamplingParams(max_tokens=16, prompt_logprobs=True, ignore_eos=True, **GREEDY)
    outs = llm.generate(prompts, params)
    check_against_hf(path, outs, prompts, 16)
    assert all(o.num_cached_tokens == 0 and o.finish_reason == "length" for o in outs)
    assert outs[0].metrics["steps"][0]["strategy"] == ("pass-kv" if cp > 1 else "local")  # full prefill
    if cp > 1:
        assert outs[0].metrics["steps"][-1]["strategy"] == "pass-q"  # decode


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("strategy", ["auto", "pass-kv", "pass-q"])
def test_three_turn_conversation_reuses_prefix(llama_checkpoint, engine, cp, strategy):
    path = llama_checkpoint("gqa", max_position_embeddings=2048)
    llm = engine(path, cp, max_kv_tokens_per_rank=2048, strategy=strategy, placement="shard")
    rng = np.random.default_rng(cp)
    prompt = rng.integers(3, 256, 150).tolist()
    params = SamplingParams(max_tokens=8, ignore_eos=True, **GREEDY)
    for turn in range(3):
        out = llm.generate([prompt], params)[0]
        check_against_hf(path, [out], [prompt], 8, check_prompt_lp=False)
        if turn:
            assert out.num_cached_tokens == len(prev_prompt) + len(prev_out) - 1
            used = out.metrics["steps"][0]["strategy"]
            assert used == strategy or strategy == "auto"
        prev_prompt, prev_out = prompt, out.token_ids
        prompt = prompt + out.token_ids + rng.integers(3, 256, 1 + 20 * turn).tolist()


def test_kv_stays_balanced_over_a_long_conversation(llama_checkpoint, engine):
    path = llama_checkpoint("gqa", max_position_embeddings=4096)
    llm = engine(path, 2, max_kv_tokens_per_rank=4096, placement="shard")  # one sequence over both ranks
    rng = np.random.default_rng(5)
    prompt = rng.integers(3, 256, 1001).tolist()
    for turn in range(3):
        out = llm.generate([prompt], SamplingParams(max_tokens=60, ignore_eos=True, temperature=1.0, seed=turn))[0]
        prompt = prompt + out.token_ids + rng.integers(3, 256, 7).tolist()
    counts = np.asarray(llm.cache_stats()["kv_tokens_per_rank"])
    assert counts.sum() == len(prompt) - 7 - 1
    assert counts.max() / counts.mean() <= 1.01, counts


def test_n_samples_with_prompt_logprobs_compute_the_prompt_once(llama_checkpoint, engine):
    """n samples of one prompt with prompt log-probs (the server's n + echo + logprobs): the first computes the
    prompt and its log-probs, the others copy them and reuse its K/V (n = 8 on 2,020 tokens computed 16,160 prompt
    tokens; now 2,020 + 7, one last token each). The log-probs equal a lone request's; each sample's own tokens are
    those of its seed alone."""
    path = llama_checkpoint("gqa", max_position_embeddings=4096)
    llm = engine(path, 2, max_kv_tokens_per_rank=4096, placement="shard")
    prompt = prompts_for(256, [301], seed=41)[0]
    params = [SamplingParams(max_tokens=3, seed=j, prompt_logprobs=True, top_logprobs=2, logprobs=True)
              for j in range(4)]
    before = llm.engine.stats()
    outs = llm.generate([prompt] * 4, params)
    after = llm.engine.stats()
    computed = (after.prefix_cache_queries - before.prefix_cache_queries) - (after.prefix_cache_hits
                                                                             - before.prefix_cache_hits)
    assert computed == len(prompt) + 3
    assert [o.num_cached_tokens for o in outs] == [0] + [len(prompt) - 1] * 3
    assert all(o.prompt_logprobs == outs[0].prompt_logprobs and o.prompt_top_logprobs == outs[0].prompt_top_logprobs
               for o in outs)
    assert outs[0].prompt_logprobs[0] is None and all(lp is not None for lp in outs[0].prompt_logprobs[1:])
    with pytest.raises(ValueError, match="top_logprobs must be at most max_logprobs = 20"):
        llm.generate([prompt], SamplingParams(top_logprobs=21))
    for j, out in enumerate(outs):  # alone: the full prompt computed for its own log-probs
        alone = llm.generate([prompt], params[j])[0]
        assert alone.token_ids == out.token_ids
        torch.testing.assert_close(torch.tensor(alone.prompt_logprobs[1:]), torch.tensor(out.prompt_logprobs[1:]),
                                   rtol=0, atol=1e-5)


def test_a_sample_whose_source_is_aborted_computes_its_own_prompt_logprobs(llama_checkpoint, engine):
    """The request that would compute the shared prompt log-probs is aborted before it runs: the waiting sample
    then computes them itself (every position but the first has one, equal to a lone request's)."""
    path = llama_checkpoint("gqa", max_position_embeddings=4096)
    llm = engine(path, 2, max_kv_tokens_per_rank=4096, placement="shard")
    eng = llm.engine
    prompt = prompts_for(256, [157], seed=43)[0]
    params = SamplingParams(max_tokens=2, seed=3, prompt_logprobs=True)
    eng.add_request("src", prompt, params)
    follower = eng.add_request("follower", prompt, params)
    assert follower.lp_source is eng.requests["src"]
    eng.abort("src")
    final = {}
    while eng.has_unfinished_requests():
        final.update({o.request_id: o for o in eng.step() if o.finished})
    assert final["src"].finish_reason == "abort" and final["follower"].finish_reason == "length"
    lps = final["follower"].prompt_logprobs
    assert lps[0] is None and all(lp is not None for lp in lps[1:]) and final["follower"].num_cached_tokens == 0
    alone = llm.generate([prompt], params)[0]
    torch.testing.assert_close(torch.tensor(alone.prompt_logprobs[1:]), torch.tensor(lps[1:]), rtol=0, atol=1e-5)


def test_without_prefix_caching_finished_requests_leave_no_kv(llama_checkpoint, engine):
    """enable_prefix_caching=False: nothing is reused, so finished requests free their K/V at once (the KV gauge
    returns to its idle value); n samples with prompt log-probs each compute their prompt."""
    path = llama_checkpoint("gqa", max_position_embeddings=4096)
    llm = engine(path, 2, max_kv_tokens_per_rank=1024, enable_prefix_caching=False)
    assert llm.cache_stats()["kv_tokens_per_rank"] == [0, 0]
    prompts = prompts_for(256, [120, 300, 5], seed=7)
    outs = llm.generate(prompts + [prompts[0]] * 2, [SamplingParams(max_tokens=4, seed=1, prompt_logprobs=True)] * 5)
    assert all(len(o.token_ids) == 4 and o.num_cached_tokens == 0 for o in outs)
    assert llm.cache_stats()["kv_tokens_per_rank"] == [0, 0]


def test_capacity_rejection_leaves_engine_serving(llama_checkpoint, engine):
    path = llama_checkpoint("gqa", max_position_embeddings=4096)
    llm = engine(path, 2, max_kv_tokens_per_rank=512)
    prompt = prompts_for(256, [100])[0]
    first = llm.generate([prompt], SamplingParams(max_tokens=4, **GREEDY))[0]
    assert llm.engine.max_model_len == 2 * (7 * 64 - 4)  # lowered: what 512 tokens per rank x CP 2 hold
    with pytest.raises(ValueError, match=r"maximum model length 888 \(what the KV cache holds for one request; the "
                                         r"model's max_position_embeddings is 4096\)"):
        llm.generate([prompts_for(256, [1500])[0]], SamplingParams(max_tokens=4))
    again = llm.generate([prompt + first.token_ids + [7, 8]], SamplingParams(max_tokens=4, **GREEDY))[0]
    assert again.num_cached_tokens == len(prompt) + len(first.token_ids) - 1  # the cache survived
    check_against_hf(path, [again], [prompt + first.token_ids + [7, 8]], 4, check_prompt_lp=False)


def test_a_max_model_len_set_beyond_the_kv_cache_is_refused_before_any_rank_starts(llama_checkpoint):
    path = llama_checkpoint("gqa", max_position_embeddings=4096)
    with pytest.raises(ValueError, match=r"max_model_len 1024 does not fit the KV cache: 256 KV tokens per rank x CP 1 "
                                         r"hold at most 190 tokens for one request \(prompt \+ output\); lower "
                                         r"max_model_len to 190 or less, or raise max_kv_tokens_per_rank or "
                                         r"context_parallel_size"):
        LLM(str(path), max_kv_tokens_per_rank=256, max_model_len=1024, threads_per_rank=1)


def test_a_measured_kv_cache_too_small_for_max_model_len_stops_the_ranks(llama_checkpoint, monkeypatch):
    """On CUDA the capacity is known once the ranks measured it: a max_model_len it cannot hold is refused then, and
    the ranks are stopped (here the measurement is stood in for by a smaller capacity than the one asked for)."""
    import multiprocessing

    from cpinfer.engine.startup import EngineStartup

    before = set(multiprocessing.active_children())  # the module's pooled engines' ranks stay
    measured = EngineStartup.start_ranks
    monkeypatch.setattr(EngineStartup, "start_ranks", lambda self, capacity: measured(self, capacity) // 4)
    path = llama_checkpoint("gqa", max_position_embeddings=4096)
    with pytest.raises(ValueError, match=r"max_model_len 1000 does not fit the KV cache: 512 KV tokens per rank x CP 2 "
                                         r"hold at most 888 tokens"):
        LLM(str(path), context_parallel_size=2, max_kv_tokens_per_rank=2048, max_model_len=1000, threads_per_rank=1,
            in_process=False)
    assert not set(multiprocessing.active_children()) - before  # this engine's rank process was stopped


def test_the_model_s_context_is_lowered_to_what_the_kv_cache_holds(llama_checkpoint, engine):
    """max_model_len not given: the model's 4096 is lowered, with one warning naming both numbers, to what 256 tokens
    per rank hold for one request; a request of exactly that length runs, one token more is refused."""
    import logging

    path = llama_checkpoint("gqa", max_position_embeddings=4096)
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append
    logging.getLogger("cpinfer").addHandler(handler)
    try:
        llm = engine(path, 1, max_kv_tokens_per_rank=256)
    finally:
        logging.getLogger("cpinfer").removeHandler(handler)
    assert llm.engine.max_model_len == 190
    warned = [r.getMessage() for r in records if "max_model_len lowered" in r.getMessage()]
    assert warned == ["max_model_len lowered from 4096 (the model's max_position_embeddings) to 190: 256 KV tokens per "
                      "rank x CP 1 hold at most 190 tokens for one request (prompt + output); raise "
                      "max_kv_tokens_per_rank or context_parallel_size to serve the model's whole context"], warned
    prompt = prompts_for(256, [180])[0]
    out = llm.generate([prompt], SamplingParams(max_tokens=10, ignore_eos=True, **GREEDY))[0]
    assert len(out.token_ids) == 10
    with pytest.raises(ValueError, match="= 191 exceeds the maximum model length 190"):
        llm.generate([prompt], SamplingParams(max_tokens=11))


def test_lru_eviction_under_pressure(llama_checkpoint, engine):
    path = llama_checkpoint("gqa", max_position_embeddings=4096)
    llm = engine(path, 2, max_kv_tokens_per_rank=640)
    prompts = prompts_for(256, [400, 400, 400], seed=9)
    for p in prompts:  # each fits alone; together they do not, so older ones are evicted
        out = llm.generate([p], SamplingParams(max_tokens=2, **GREEDY))[0]
        check_against_hf(path, [out], [p], 2, check_prompt_lp=False)
    assert sum(llm.cache_stats()["kv_tokens_per_rank"]) <= 2 * 640
    again = llm.generate([prompts[0]], SamplingParams(max_tokens=2, **GREEDY))[0]
    assert again.num_cached_tokens == 0  # the oldest conversation was evicted first


@pytest.mark.parametrize("bad, match", [
    (dict(prompts=[[]]), "prompt is empty"),
    (dict(prompts=[[1, 2, 10_000]]), "outside"),
    (dict(prompts=["hello"]), "no tokenizer"),
    (dict(prompts=[list(range(3, 200))] * 1, max_tokens=5000), "max_position_embeddings"),
])
def test_bad_requests_raise_and_engine_keeps_serving(llama_checkpoint, engine, bad, match):
    path = llama_checkpoint("gqa", max_position_embeddings=2048)
    llm = engine(path, 2, max_kv_tokens_per_rank=2048)
    with pytest.raises(ValueError, match=match):
        llm.generate(bad["prompts"], SamplingParams(max_tokens=bad.get("max_tokens", 4)))
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2, **GREEDY))[0]
    assert len(out.token_ids) == 2


def test_stop_tokens_and_sampling_params(llama_checkpoint, engine):
    path = llama_checkpoint("gqa", max_position_embeddings=2048)
    llm = engine(path, 2, max_kv_tokens_per_rank=2048)
    prompt = prompts_for(256, [40], seed=3)[0]
    greedy = llm.generate([prompt], SamplingParams(max_tokens=6, ignore_eos=True, **GREEDY))[0].token_ids
    stopped = llm.generate([prompt], SamplingParams(max_tokens=6, stop_token_ids=[greedy[2]], ignore_eos=True,
                                                    **GREEDY))[0]
    assert stopped.token_ids == greedy[:greedy.index(greedy[2]) + 1] and stopped.finish_reason == "stop"
    a = llm.generate([prompt], SamplingParams(max_tokens=6, seed=11, top_k=20, top_p=0.9))[0].token_ids
    b = llm.generate([prompt], SamplingParams(max_tokens=6, seed=11, top_k=20, top_p=0.9))[0].token_ids
    assert a == b  # seeded sampling is reproducible
    for kw in (dict(max_tokens=0), dict(max_tokens=-1), dict(temperature=-1.0), dict(top_p=0.0), dict(top_k=-2)):
        with pytest.raises(ValueError):
            SamplingParams(**kw)


def test_bad_engine_arguments(llama_checkpoint, tmp_path):
    path = llama_checkpoint("gqa")
    for kw, match in ((dict(context_parallel_size=0), "context_parallel_size"),
                      (dict(context_parallel_size="2"), "context_parallel_size"),
                      (dict(strategy="ring"), "strategy"), (dict(dtype="int8"), "dtype"),
                      (dict(max_kv_tokens_per_rank=10), "max_kv_tokens_per_rank"),
                      (dict(max_logprobs=-2), "max_logprobs"), (dict(max_logprobs=True), "max_logprobs")):
        with pytest.raises(ValueError, match=match):
            LLM(str(path), **kw)
    with pytest.raises(ValueError):
        LLM(str(tmp_path / "missing"))
    import shutil
    broken = tmp_path / "broken"
    shutil.copytree(path, broken)
    for f in broken.glob("*.safetensors"):
        f.unlink()
    with pytest.raises(ValueError, match="safetensors"):
        LLM(str(broken))


def test_mismatched_checkpoint_is_a_clear_error(llama_checkpoint, tmp_path):
    import json
    import shutil
    path = llama_checkpoint("gqa")
    bad = tmp_path / "mismatch"
    shutil.copytree(path, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["intermediate_size"] += 8  # weights no longer match the config
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="shape"):
        LLM(str(bad), context_parallel_size=2, threads_per_rank=1, timeout_s=60)


def test_request_finishing_in_prefill_releases_its_cache(llama_checkpoint, engine):
    path = llama_checkpoint("gqa", max_position_embeddings=4096)
    llm = engine(path, 2, max_kv_tokens_per_rank=512)
    for seed in range(6):  # without release, these would exhaust the 512-token ranks
        prompt = prompts_for(256, [300], seed=seed)[0]
        out = llm.generate([prompt], SamplingParams(max_tokens=1, **GREEDY))[0]
        assert out.finish_reason == "length" and len(out.token_ids) == 1
    again = llm.generate([prompt + out.token_ids + [3]], SamplingParams(max_tokens=1, **GREEDY))[0]
    assert again.num_cached_tokens == len(prompt)


def test_calibrated_profile_drives_the_partial_prefill_choice(llama_checkpoint, tmp_path):
    import dataclasses

    from cpinfer.perf.hardware import load_hardware_profile
    path = llama_checkpoint("gqa", max_position_embeddings=2048)
    prof = dataclasses.replace(load_hardware_profile("cpu-gloo"), name="my-cluster", empirical=(0.0, 0.0, -1.0))
    prof_path = tmp_path / "profile.json"
    prof.to_json(prof_path)  # h = -1 everywhere: always pass-Q for partial prefill
    with pytest.raises(ValueError):
        LLM(str(path), hardware_profile=str(tmp_path / "nope.json"))
    with LLM(str(path), context_parallel_size=2, hardware_profile=str(prof_path), threads_per_rank=1,
             placement="shard") as llm:
        prompt = prompts_for(256, [300], seed=4)[0]
        first = llm.generate([prompt], SamplingParams(max_tokens=2, **GREEDY))[0]
        turn2 = prompt + first.token_ids + [9] * 200  # T large enough that Alg. 5 would pick pass-KV
        out = llm.generate([turn2], SamplingParams(max_tokens=2, **GREEDY))[0]
    step = out.metrics["steps"][0]
    assert (step["strategy"], step["method"]) == ("pass-q", "empirical")
    assert step["inputs"]["coeffs_from"] == "profile my-cluster"


def test_steps_report_host_timings(llama_checkpoint, engine):
    """Every forward's step metrics carry its host-side seconds (schedule, forward, rank 0's plan / model /
    sample, process with detokenizing): present, non-negative, nested as measured, one dict per forward."""
    path = llama_checkpoint("gqa", max_position_embeddings=2048)
    llm = engine(path, 1, max_kv_tokens_per_rank=2048, placement="shard")
    out = llm.generate([list(range(3, 40))], SamplingParams(max_tokens=4, ignore_eos=True, **GREEDY))[0]
    hosts = [st["host"] for st in out.metrics["steps"]]
    assert len(hosts) == 4 and len({id(h) for h in hosts}) == 4
    for h in hosts:
        assert {"schedule_s", "forward_s", "rank0_plan_s", "rank0_model_s", "rank0_sample_s", "process_s",
                "detokenize_s"} <= set(h), h
        assert all(v >= 0 for v in h.values()), h
        assert h["forward_s"] >= h["rank0_plan_s"] + h["rank0_model_s"] + h["rank0_sample_s"]
        assert h["process_s"] >= h["detokenize_s"]


def test_dummy_weights_run_as_if_loaded(tmp_path):
    """load_format="dummy": random weights made on the device from config.json alone (no weight files); the engine
    then computes exactly what it computes with the same weights read from a checkpoint."""
    import json

    from safetensors.torch import save_file

    from cpinfer.model import ModelConfig
    from cpinfer.model.loader import random_model
    from cpinfer.model.random_checkpoint import random_config_dict

    cfg = random_config_dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                             num_key_value_heads=2, num_hidden_layers=2)
    bare, full = tmp_path / "bare", tmp_path / "full"
    for d in (bare, full):
        d.mkdir()
        (d / "config.json").write_text(json.dumps(cfg))
    model = random_model(ModelConfig.from_dict(cfg))  # what the dummy engine makes on the CPU (seed 0)
    sd = {n: p.detach().clone() for n, p in model.state_dict().items()}
    assert all(sd[n].std() > 0 for n in sd) and not torch.equal(sd["model.norm.weight"], torch.ones(32))
    save_file(sd, str(full / "model.safetensors"))
    with pytest.raises(ValueError, match="load_format must be one of"):
        LLM(str(bare), load_format="random")
    with pytest.raises(ValueError, match="no \\*.safetensors"):
        LLM(str(bare), max_kv_tokens_per_rank=256)
    prompt = list(range(5, 40))
    params = SamplingParams(max_tokens=6, ignore_eos=True, prompt_logprobs=True, **GREEDY)
    outs = []
    for path, fmt in ((bare, "dummy"), (full, "auto")):
        with LLM(str(path), load_format=fmt, max_kv_tokens_per_rank=256, threads_per_rank=1) as llm:
            outs.append(llm.generate([prompt], params)[0])
    assert outs[0].token_ids == outs[1].token_ids
    torch.testing.assert_close(torch.tensor(outs[0].logprobs), torch.tensor(outs[1].logprobs), rtol=0, atol=0)
    torch.testing.assert_close(torch.tensor(outs[0].prompt_logprobs[1:]), torch.tensor(outs[1].prompt_logprobs[1:]),
                               rtol=0, atol=0)
