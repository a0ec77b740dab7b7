"""Prefill and decode groups in a joined world: under torchrun and over `--nnodes` "nodes" on 127.0.0.1, equal to
one process at CP 1; a decode rank that dies ends the driver in seconds. Each case starts its own few processes
(the world is the launcher's) and kills whatever is left of them."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest
import torch

from server_utils import ServerProcess, descendants, environ_of, free_port, is_alive, kill_trees, served_checkpoint
from wait_utils import DEAD_NODE_EXIT_S, wait_until

PROMPT = list(range(3, 43))  # 40 tokens, spread over the prefill ranks (placement shard): the ring crosses them
MAX_TOKENS = 6
ENGINE = ["--device", "cpu", "--threads-per-rank", "1", "--placement", "shard", "--max-kv-tokens-per-rank", "4096"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def model_dir(llama_checkpoint, tmp_path_factory):
    """The tiny GQA checkpoint with the tiny byte-level tokenizer beside it (the server needs one)."""
    return served_checkpoint(llama_checkpoint, tmp_path_factory, "pd_multinode_model")


@pytest.fixture(scope="module")
def reference(model_dir):
    """Greedy tokens and log-probs of PROMPT on one process at CP 1 (the single-device reference)."""
    from cpinfer import LLM, SamplingParams

    with LLM(str(model_dir), context_parallel_size=1, threads_per_rank=1) as llm:
        out = llm.generate([PROMPT], SamplingParams(max_tokens=MAX_TOKENS, logprobs=True, temperature=0.0,
                                                    ignore_eos=True))[0]
    return out.token_ids, out.logprobs, out.text


def _check(res: dict, reference, decode_cp: int) -> None:
    assert res["token_ids"] == reference[0], (res["token_ids"], reference[0])
    torch.testing.assert_close(torch.tensor(res["logprobs"]), torch.tensor(reference[1]), atol=1e-4, rtol=0)
    pd = res["pd"]
    assert pd["transfer_tokens"] == len(PROMPT) and pd["transfer_bytes"] > 0, pd  # the prompt's K/V moved once
    assert pd["decode_group"] == 0, pd


def test_torchrun_prefill_cp2_decode_cp1_matches_one_process(model_dir, reference, tmp_path):
    """torchrun, one node of 3 processes: prefill CP 2 on ranks 0-1 (rank 0 also drives), decode CP 1 on rank 2."""
    port = free_port()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "3",
           "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"pd{port}",
           "-m", "cpinfer", "generate", str(model_dir), "--cp", "2", "--pd-decode-cp", "1", "--max-tokens",
           str(MAX_TOKENS), "--ignore-eos", *ENGINE, "--prompt-ids", ",".join(map(str, PROMPT)), "--json"]
    log = open(tmp_path / "torchrun.log", "w+")
    agent = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True, env=ENV)
    try:
        code = agent.wait(timeout=240)
        out = (tmp_path / "torchrun.log").read_text()
        assert code == 0, out[-4000:]
    finally:
        kill_trees(agent)
    res = json.loads(next(line for line in reversed(out.splitlines()) if line.startswith("{")))
    _check(res, reference, 1)
    assert "prefill/decode: prefill CP 2" in out and "to decode group 0 (CP 1)" in out, out[-3000:]


def _nodes(port: int) -> list[str]:
    return ["--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", str(port)]


def _start(args: list[str], log) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "cpinfer", *args], stdout=log, stderr=subprocess.STDOUT,
                            text=True, env=ENV)


def test_two_nodes_prefill_cp2_decode_cp2_matches_one_process(model_dir, reference, tmp_path):
    """--nnodes 2 of two ranks each: node 0 holds the prefill group (rank 0 drives), node 1 the decode group, so
    every K/V row crosses the nodes; every process ends when the driver is done."""
    port = free_port()
    common = ["generate", str(model_dir), "--cp", "2", "--pd-decode-cp", "2", "--max-tokens", str(MAX_TOKENS),
              "--ignore-eos", *ENGINE, *_nodes(port)]
    logs = [open(tmp_path / f"node{i}.log", "w+") for i in range(2)]
    headless = _start([*common, "--node-rank", "1", "--headless"], logs[1])
    driver = _start([*common, "--node-rank", "0", "--prompt-ids", ",".join(map(str, PROMPT)), "--json"], logs[0])
    try:
        codes = [driver.wait(timeout=240), headless.wait(timeout=60)]
        out = [(tmp_path / f"node{i}.log").read_text() for i in range(2)]
        assert codes == [0, 0], "\n---\n".join(o[-3000:] for o in out)
    finally:
        kill_trees(driver, headless)
    res = json.loads(out[0].strip().splitlines()[-1])
    _check(res, reference, 2)
    assert "runs ranks 2..3" in out[1] and "the driver ended the world" in out[1], out[1][-2000:]
    assert "decode group 0 CP 2 x TP 1 on ranks [2, 3]" in out[0], out[0][-3000:]


def test_two_nodes_serve_then_a_killed_decode_rank_ends_the_driver(model_dir, reference, tmp_path):
    """Node 0 serves (prefill CP 1 on rank 0, decode CP 1 on node 1's rank 1) what one process at CP 1 computes;
    SIGKILL to the decode rank makes node 0 exit 1 within seconds, naming the lost rank; no process is left."""
    port = free_port()
    common = ["--model", str(model_dir), "--served-model-name", "tiny", "--cp", "1", "--pd-decode-cp", "1",
              "--log-level", "warning", *ENGINE, *_nodes(port)]
    log = open(tmp_path / "headless.log", "w+")
    headless = _start(["serve", *common, "--node-rank", "1", "--headless"], log)
    server = None
    try:
        server = ServerProcess([*common, "--node-rank", "0"], start_timeout=240)
        r = httpx.post(server.url + "/v1/completions", timeout=120, json={
            "model": "tiny", "prompt": PROMPT, "max_tokens": MAX_TOKENS, "logprobs": 1, "temperature": 0.0,
            "ignore_eos": True})
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["text"] == reference[2]
        torch.testing.assert_close(torch.tensor(choice["logprobs"]["token_logprobs"]), torch.tensor(reference[1]),
                                   atol=1e-4, rtol=0)
        ranks = descendants(headless.pid)
        assert [environ_of(p).get("RANK") for p in ranks] == ["1"], ranks
        os.kill(ranks[0], signal.SIGKILL)
        t0 = time.monotonic()
        code = server.proc.wait(timeout=60)
        took = time.monotonic() - t0
        out = server.output()
        print(f"node 0 exited {took:.1f} s after the decode rank was killed")
        assert code == 1 and took < DEAD_NODE_EXIT_S, (code, took, out[-3000:])
        assert "the engine is dead" in out and "rank 1 is gone" in out, out[-3000:]
        assert headless.wait(timeout=60) == 1
        wait_until(lambda: not any(is_alive(p) for p in ranks), 60, 0.05, "the killed rank reaped")
    finally:
        kill_trees(*([server.proc] if server is not None else []), headless)


def test_joined_world_subsets_run_side_by_side_and_a_raising_rank_is_reported(tmp_path):
    """JoinedWorld(subsets=True) on 3 processes: `run` / `run_some` (a group collective on ranks 0-1), rank 0's own
    2 s call on its worker thread while ranks 1 and 2 answer many calls; an abandoned call's late replies are
    dropped; a rank that raises is reported with its
    error, exits, and the world refuses further calls; the others exit 0 when rank 0 closes the world."""
    port = free_port()
    out = tmp_path / "seen.json"
    script = os.path.join(os.path.dirname(__file__), "scripts", "joined_subsets.py")
    procs = [subprocess.Popen([sys.executable, script, str(out)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, env={**ENV, "RANK": str(r), "WORLD_SIZE": "3", "MASTER_ADDR": "127.0.0.1",
                                              "MASTER_PORT": str(port)}) for r in range(3)]
    try:
        logs = [p.communicate(timeout=120)[0] for p in procs]
    finally:
        kill_trees(*procs)
    codes = [p.returncode for p in procs]
    assert codes == [0, 0, 1], (codes, "\n---\n".join(logs))
    seen = json.loads(out.read_text())
    assert seen["run"] == [0, 1, 2] and seen["run_some"] == [3, 3, None], seen
    assert seen["rank0"] == [0] and seen["rounds"] >= 10 and 1.9 < seen["waited_s"] < 30, seen
    assert seen["fresh"] == [[0, "new"], None, [2, "new"], None, [1, "new"], None], seen  # never an "old" reply
    assert seen["dropped"] == 3, seen
    assert seen["error"] == [[2], "ValueError", "rank 2 fails on purpose"], seen
    assert seen["dead_reason"].startswith("rank 2 raised ValueError"), seen
    assert "the joined world is unusable: rank 2 raised ValueError" in seen["after"], seen
    assert "rank 2: boom raised ValueError: rank 2 fails on purpose" in logs[2], logs[2]


def test_torchrun_world_of_the_wrong_size_is_refused_on_every_rank(model_dir, tmp_path):
    """Prefill CP 2 + decode CP 1 needs 3 processes: torchrun with 2 fails before any model loads, naming both
    numbers."""
    port = free_port()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
           "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"pd{port}",
           "-m", "cpinfer", "generate", str(model_dir), "--cp", "2", "--pd-decode-cp", "1", *ENGINE,
           "--prompt-ids", "1,2,3"]
    agent = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=ENV)
    try:
        out, _ = agent.communicate(timeout=180)
    finally:
        kill_trees(agent)
    assert agent.returncode != 0, out[-3000:]
    assert "(2 + 1 x 1) x 1 = 3 ranks, but the launched world has 2 processes" in out, out[-3000:]
