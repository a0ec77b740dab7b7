"""CP × TP: exactness vs Hugging Face for several layouts, KV-head replication, torchrun on two local "nodes"."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cpinfer import LLM, SamplingParams
from cpinfer.distributed import ParallelConfig
from cpinfer.launch import free_port
from hf_oracle import check_against_hf, prompts_for
from pooled_engine import keyed_engines

SCRIPT = Path(__file__).parent / "scripts" / "torchrun_generate.py"
GREEDY = dict(temperature=0.0, logprobs=True, ignore_eos=True)


@pytest.fixture(scope="module")
def engines():
    """`engines(path, cp, tp, **kw)`: an LLM on one pool of ranks per world size shared by the module."""
    yield from keyed_engines(threads_per_rank=1, timeout_s=120)


@pytest.mark.parametrize("variant,cp,tp,placement", [
    ("gqa", 2, 2, "shard"), ("gqa", 1, 2, "shard"), ("gqa", 2, 1, "shard"),
    ("mqa", 2, 2, "local"),  # 1 KV head, TP2: the KV head is replicated on both TP ranks; each request on 1 CP rank
    ("gqa", 1, 4, "shard"),  # 2 KV heads, TP4: each KV head replicated twice
])
def test_cp_tp_exact_with_partial_prefill_and_decode(llama_checkpoint, engines, variant, cp, tp, placement):
    path = llama_checkpoint(variant, max_position_embeddings=2048)
    prompts = prompts_for(256, [23, 70], seed=cp * 10 + tp)
    with engines(path, cp, tp, max_kv_tokens_per_rank=2048, placement=placement) as llm:
        outs = llm.generate(prompts, SamplingParams(max_tokens=10, prompt_logprobs=True, **GREEDY))
        check_against_hf(path, outs, prompts, 10)
        turn2 = [p + o.token_ids + [11, 12, 13] for p, o in zip(prompts, outs)]
        outs2 = llm.generate(turn2, SamplingParams(max_tokens=8, **GREEDY))
        assert [o.num_cached_tokens for o in outs2] == [len(p) + 9 for p in prompts]
        check_against_hf(path, outs2, turn2, 8, check_prompt_lp=False)
        if cp > 1:  # local: the two requests on different CP ranks, no ring; shard: both spread
            assert {o.metrics["steps"][0]["placement"] for o in outs + outs2} == \
                {"local" if placement == "local" else "spread"}


@pytest.mark.parametrize("cp,tp,heads,kv,match", [
    (1, 3, 8, 2, "divide the number of attention heads"),
    (1, 8, 8, 3, "key/value heads"),
    (0, 2, 8, 2, "positive integer"),
])
def test_parallel_config_rejects_bad_layouts(cp, tp, heads, kv, match):
    with pytest.raises(ValueError, match=match):
        ParallelConfig(cp, tp).check_model(heads, kv)


def test_llm_rejects_tp_that_cannot_split_heads(llama_checkpoint):
    path = llama_checkpoint("gqa")
    with pytest.raises(ValueError, match="tensor_parallel_size 3"):
        LLM(str(path), context_parallel_size=1, tensor_parallel_size=3)


def _torchrun(nproc: int, nnodes: int, args: list[str], timeout: float = 240) -> list[subprocess.CompletedProcess]:
    port = free_port()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nnodes), "--nproc-per-node", str(nproc),
           "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"t{port}",
           str(SCRIPT), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
             for _ in range(nnodes)]
    results = []
    for p in procs:
        out, _ = p.communicate(timeout=timeout)
        results.append(subprocess.CompletedProcess(cmd, p.returncode, out))
    return results


def test_torchrun_two_nodes_cp2_tp2_matches_single_process(llama_checkpoint, tmp_path):
    path = llama_checkpoint("gqa", max_position_embeddings=2048)
    out = tmp_path / "tokens.json"
    runs = _torchrun(2, 2, [str(path), "2", "2", str(out)])
    assert all(r.returncode == 0 for r in runs), "\n".join(r.stdout[-3000:] for r in runs)
    got = json.loads(out.read_text())
    prompt = list(range(3, 83))
    with LLM(str(path), context_parallel_size=1, threads_per_rank=1) as llm:
        first = llm.generate([prompt], SamplingParams(max_tokens=6, **GREEDY))[0]
        second = llm.generate([prompt + first.token_ids + [9, 10]], SamplingParams(max_tokens=6, **GREEDY))[0]
    assert got["first"] == first.token_ids and got["second"] == second.token_ids
    assert got["cached"] == second.num_cached_tokens == len(prompt) + 5
    torch.testing.assert_close(torch.tensor(got["logprobs"]), torch.tensor(first.logprobs + second.logprobs),
                               atol=1e-4, rtol=0)


def test_torchrun_mismatched_launch_fails_fast_on_every_rank(llama_checkpoint, tmp_path):
    path = llama_checkpoint("gqa")
    runs = _torchrun(2, 1, [str(path), "2", "2", str(tmp_path / "never.json")], timeout=120)
    assert runs[0].returncode != 0
    assert runs[0].stdout.count("launched world has 2 processes") >= 2  # both ranks say why
    assert not (tmp_path / "never.json").exists()


def test_cp_vs_tp_bench_runs_small():
    res = subprocess.run([sys.executable, "-m", "cpinfer", "bench", "cp-vs-tp", "--tokens", "128", "--hidden", "64",
                          "--heads", "4", "--kv-heads", "2", "--ffn", "128", "--vocab", "256", "--repeat", "1",
                          "--json"], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    rows = json.loads(res.stdout.strip().splitlines()[-1])["rows"]
    assert [r["layout"] for r in rows] == ["CP1", "CP2", "TP2"]
    assert all(r["ttft_s"] > 0 and 0 <= r["comm_share"] <= 1 for r in rows)
