"""`--nnodes R --node-rank i --master-addr H --master-port P [--headless]`: two "nodes" on 127.0.0.1 (two CLI
processes each), checked against one process at CP 1; a node that dies is seen in seconds; bad flags are refused
before anything starts."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest
import torch

from cpinfer.cli import main
from cpinfer.multinode import NodeSpec, interface_toward
from server_utils import ServerProcess, descendants, free_port, is_alive, kill_trees, served_checkpoint
from wait_utils import DEAD_NODE_EXIT_S, wait_until

PROMPT = list(range(3, 43))  # 40 tokens: 20 per CP rank, spread (placement shard) so the ring crosses nodes
GREEDY = {"temperature": 0.0, "ignore_eos": True}
ENGINE = ["--device", "cpu", "--threads-per-rank", "1", "--placement", "shard", "--max-kv-tokens-per-rank", "4096"]


def _nodes(port: int, nnodes: int = 2) -> list[str]:
    return ["--nnodes", str(nnodes), "--master-addr", "127.0.0.1", "--master-port", str(port)]


def _start(args: list[str], log) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "cpinfer", *args], stdout=log, stderr=subprocess.STDOUT,
                            text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})


@pytest.fixture(scope="module")
def model_dir(llama_checkpoint, tmp_path_factory):
    """The tiny GQA checkpoint with the tiny byte-level tokenizer beside it (the server needs one)."""
    return served_checkpoint(llama_checkpoint, tmp_path_factory, "multinode_model")


@pytest.fixture(scope="module")
def reference(model_dir):
    """Greedy tokens and log-probs of PROMPT on one process at CP 1 (the single-device reference)."""
    from cpinfer import LLM, SamplingParams

    with LLM(str(model_dir), context_parallel_size=1, threads_per_rank=1) as llm:
        out = llm.generate([PROMPT], SamplingParams(max_tokens=6, logprobs=True, **GREEDY))[0]
    return out.token_ids, out.logprobs, out.text


# ---------------------------------------------------------------------------------------------- two nodes
def test_generate_over_two_nodes_cp2_tp2_matches_one_process(model_dir, reference, tmp_path):
    """CP 2 x TP 2 over two nodes (two ranks each: node 0 runs the driver and one child rank, node 1 two headless
    ranks): the tokens and log-probs of one process at CP 1, and every process ends when the driver is done."""
    port = free_port()
    common = ["generate", str(model_dir), "--cp", "2", "--tp", "2", "--max-tokens", "6", "--ignore-eos", *ENGINE,
              *_nodes(port)]
    logs = [open(tmp_path / f"node{i}.log", "w+") for i in range(2)]
    headless = _start([*common, "--node-rank", "1", "--headless"], logs[1])  # before node 0: it waits for it
    driver = _start([*common, "--node-rank", "0", "--prompt-ids", ",".join(map(str, PROMPT)), "--json"], logs[0])
    try:
        codes = [driver.wait(timeout=240), headless.wait(timeout=60)]
        out = [(tmp_path / f"node{i}.log").read_text() for i in range(2)]
        assert codes == [0, 0], "\n---\n".join(o[-3000:] for o in out)
    finally:
        kill_trees(driver, headless)
    res = json.loads(out[0].strip().splitlines()[-1])
    assert res["token_ids"] == reference[0]
    torch.testing.assert_close(torch.tensor(res["logprobs"]), torch.tensor(reference[1]), atol=1e-4, rtol=0)
    assert min(res["new_tokens_per_rank"]) > 0, res  # the prompt was spread over both CP ranks (both nodes)
    assert "runs ranks 2..3" in out[1] and "the driver ended the world" in out[1], out[1][-2000:]


def _completion(url: str) -> tuple[str, list[float]]:
    r = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": PROMPT, "max_tokens": 6, "logprobs": 1,
                                                  **GREEDY}, timeout=120)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    return choice["text"], choice["logprobs"]["token_logprobs"]


def _serve_pair(model_dir, tmp_path) -> tuple[ServerProcess, subprocess.Popen]:
    """Node 1 headless, then node 0 serving HTTP (CP 2, one rank per node), ready."""
    port = free_port()
    common = ["--model", str(model_dir), "--served-model-name", "tiny", "--cp", "2", "--log-level", "warning",
              *ENGINE, *_nodes(port)]
    log = open(tmp_path / "headless.log", "w+")
    headless = _start(["serve", *common, "--node-rank", "1", "--headless"], log)
    try:
        server = ServerProcess([*common, "--node-rank", "0"], start_timeout=240)
    except BaseException:
        kill_trees(headless)
        raise
    return server, headless


def test_serve_over_two_nodes_matches_one_process_and_a_dead_node_ends_the_server(model_dir, reference, tmp_path):
    """Node 0 serves what one process at CP 1 computes; SIGKILL to the headless node (its rank dies with it) makes
    node 0 close with exit code 1 within seconds, naming the lost rank; no process is left."""
    server, headless = _serve_pair(model_dir, tmp_path)
    try:
        text, logprobs = _completion(server.url)
        assert text == reference[2] and len(logprobs) == len(reference[0]) == 6
        torch.testing.assert_close(torch.tensor(logprobs), torch.tensor(reference[1]), atol=1e-4, rtol=0)
        ranks = descendants(headless.pid)
        assert len(ranks) == 1 and descendants(server.proc.pid) == [], (ranks, descendants(server.proc.pid))
        headless.kill()
        t0 = time.monotonic()
        code = server.proc.wait(timeout=DEAD_NODE_EXIT_S + 30)
        took = time.monotonic() - t0
        out = server.output()
        assert code == 1 and took < DEAD_NODE_EXIT_S, (code, took, out[-3000:])
        assert "the engine is dead" in out and "Connection closed by peer" in out, out[-3000:]
        assert "multi-node: the world of 2 ranks over 2 nodes lost a rank" in out, out[-3000:]
        # the headless node's rank dies with its launcher (polled: a loaded machine reaps slowly)
        wait_until(lambda: not any(is_alive(p) for p in ranks), 60, 0.05, "the headless node's rank exited")
    finally:
        kill_trees(server.proc, headless)


def test_sigterm_to_every_node_stops_the_world_cleanly(model_dir, tmp_path):
    """As an orchestrator stops a job (SIGTERM to every node at once): node 0 finishes, shuts the world down and
    exits 0; the headless node leaves the shutdown to it and exits 0 once its rank has left; no process is left."""
    server, headless = _serve_pair(model_dir, tmp_path)
    try:
        ranks = descendants(headless.pid)
        headless.send_signal(signal.SIGTERM)
        server.proc.send_signal(signal.SIGTERM)
        codes = [server.proc.wait(timeout=60), headless.wait(timeout=60)]
        out = server.output(), (tmp_path / "headless.log").read_text()
        assert codes == [0, 0], "\n---\n".join(o[-3000:] for o in out)
        assert "server stopped; every rank exited" in out[0]
        assert "the driver ended the world; every rank of this node exited" in out[1], out[1][-3000:]
        assert not any(is_alive(p) for p in ranks)
    finally:
        kill_trees(server.proc, headless)


def test_headless_node_exits_in_seconds_when_the_driver_dies(model_dir, tmp_path):
    """A first SIGTERM to the headless node leaves the shutdown to the driver (the node keeps running); SIGKILL to
    node 0 (the driver): the headless node's rank sees the world gone and the node exits 1."""
    server, headless = _serve_pair(model_dir, tmp_path)
    try:
        ranks = descendants(headless.pid)
        headless.send_signal(signal.SIGTERM)
        wait_until(lambda: "SIGTERM: waiting for the driver on node 0" in (tmp_path / "headless.log").read_text(),
                   60, 0.05, "the headless node's answer to SIGTERM")  # handled: it leaves the shutdown to node 0
        assert headless.poll() is None and all(is_alive(p) for p in ranks)
        assert httpx.get(server.url + "/health", timeout=10).status_code == 200
        server.proc.kill()
        t0 = time.monotonic()
        code = headless.wait(timeout=DEAD_NODE_EXIT_S + 30)
        took = time.monotonic() - t0
        out = (tmp_path / "headless.log").read_text()
        assert code == 1 and took < DEAD_NODE_EXIT_S, (code, took, out[-3000:])
        assert "SIGTERM: waiting for the driver on node 0 to end the world" in out, out[-3000:]
        assert "rank 1 left the world" in out and "the world is gone" in out, out[-3000:]
        assert not any(is_alive(p) for p in ranks)
    finally:
        kill_trees(server.proc, headless)


# ---------------------------------------------------------------------------------------------- bad flags
@pytest.mark.parametrize("command,flags,message", [
    ("generate", ["--cp", "3", "--nnodes", "2", "--master-addr", "127.0.0.1"],
     "world has 3 ranks, which --nnodes 2 does not divide: every node runs world / nnodes ranks (allowed --nnodes: "
     "1, 3)"),
    ("serve", ["--cp", "2", "--tp", "2", "--nnodes", "3", "--master-addr", "127.0.0.1"],
     "world has 4 ranks, which --nnodes 3 does not divide"),
    ("generate", ["--cp", "2", "--nnodes", "2", "--node-rank", "2", "--master-addr", "127.0.0.1", "--headless"],
     "--node-rank 2 is out of range for --nnodes 2: allowed 0 .. 1"),
    ("serve", ["--cp", "2", "--nnodes", "2", "--node-rank", "-1", "--master-addr", "127.0.0.1"],
     "--node-rank -1 is out of range"),
    ("serve", ["--cp", "2", "--nnodes", "2"], "--nnodes 2 needs --master-addr HOST"),
    ("serve", ["--cp", "2", "--nnodes", "2", "--node-rank", "1", "--master-addr", "127.0.0.1"], "add --headless"),
    ("generate", ["--cp", "2", "--nnodes", "2", "--master-addr", "127.0.0.1", "--headless"],
     "leave --headless out on --node-rank 0"),
    ("serve", ["--node-rank", "1", "--headless"], "needs --nnodes >= 2"),
    ("serve", ["--cp", "2", "--pd-decode-cp", "1", "--nnodes", "2", "--master-addr", "127.0.0.1"],
     "world has 3 ranks, which --nnodes 2 does not divide"),  # prefill and decode groups: (2 + 1) x 1 ranks
    ("generate", ["--cp", "2", "--pd-decode-cp", "1", "--pd-decode-groups", "2", "--tp", "2", "--nnodes", "3",
                  "--master-addr", "127.0.0.1"], "world has 8 ranks, which --nnodes 3 does not divide"),
])
def test_bad_multinode_flags_are_refused_before_anything_starts(command, flags, message, capsys, tmp_path):
    """The model path does not exist: the flags are refused first, with the message, and no process starts."""
    before = descendants(os.getpid())
    extra = ["--prompt-ids", "1,2"] if command == "generate" else []
    assert main([command, str(tmp_path / "no-such-model"), "--device", "cpu", *flags, *extra]) == 2
    err = capsys.readouterr().err
    assert message in err and "no-such-model" not in err, err
    assert descendants(os.getpid()) == before


def test_bad_master_port_and_busy_rendezvous_are_refused(model_dir, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["serve", "--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", "0"])
    assert exc.value.code == 2 and "must be a TCP port in [1, 65535]" in capsys.readouterr().err
    with socket.socket() as busy:  # node 0 must bind the rendezvous: a taken port fails before any rank starts
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        flags = ["--cp", "2", *ENGINE, *_nodes(busy.getsockname()[1])]
        assert main(["generate", str(model_dir), *flags, "--prompt-ids", "1,2"]) == 2
    err = capsys.readouterr().err
    assert "node 0 cannot listen on 127.0.0.1:" in err and "--master-port a free port" in err, err
    assert main(["generate", str(model_dir), "--cp", "2", "--device", "cpu", "--nnodes", "2", "--master-addr",
                 "no-such-host.invalid", "--prompt-ids", "1,2"]) == 2
    assert "does not resolve" in capsys.readouterr().err


def test_nnodes_is_refused_under_torchrun(monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert main(["serve", str(tmp_path), "--device", "cpu", "--cp", "2", *_nodes(29500)]) == 2
    assert "under torchrun (RANK and WORLD_SIZE are set) leave --nnodes" in capsys.readouterr().err


def test_generate_needs_a_prompt_except_headless(capsys, tmp_path):
    assert main(["generate", str(tmp_path), "--device", "cpu"]) == 2
    assert "give the prompt as --prompt TEXT or --prompt-ids IDS" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------- pieces
def test_node_spec_splits_the_world_evenly_and_sets_torchruns_variables():
    spec = NodeSpec(nnodes=3, node_rank=2, master_addr="10.0.0.1", master_port=29500, world_size=48,
                    headless=True)
    assert spec.ranks_per_node == 16 and list(spec.local_ranks) == list(range(32, 48))
    env = spec.env(35)
    assert env == {"RANK": "35", "WORLD_SIZE": "48", "LOCAL_RANK": "3", "LOCAL_WORLD_SIZE": "16", "GROUP_RANK": "2",
                   "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}
    with pytest.raises(ValueError, match="allowed --nnodes: 1, 2, 3, 4, 6, 12"):
        NodeSpec(5, 0, "h", 1, 12)


def test_interface_toward_loopback_is_loopback():
    names = [n for _, n in socket.if_nameindex()]
    assert interface_toward("127.0.0.1") in [n for n in names if n.startswith("lo")]


def test_serve_help_has_a_multi_node_group(capsys):
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    text = capsys.readouterr().out
    group = text[text.index("multi-node:"):]
    for flag in ("--nnodes", "--node-rank", "--master-addr", "--master-port", "--headless"):
        assert flag in group
