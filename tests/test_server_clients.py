"""Real clients against `cpinfer serve` (CP2, a tiny random Llama, the tiny byte-level tokenizer), one server for the
module: lm-eval's `local-completions` gives the same per-sample scores and generations as lm-eval's own `hf` backend
on the same weights (a log-likelihood task and a generate-until task written here from tests/data, no download);
echo + prompt log-probs equal transformers' log-softmax (CP2 through the server, CP1 offline); batched prompts, `n`
and penalties through the `openai` SDK; vLLM's `bench serve` request shape.
"""
from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
import torch

from server_utils import ServerProcess, served_checkpoint

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.timeout(400)

MAX_LEN = 256
NAME = "tiny"
DATA = Path(__file__).parent / "data" / "lm_eval_tiny"
SERVE_ARGS = ["--cp", "2", "--served-model-name", NAME, "--max-model-len", str(MAX_LEN), "--threads-per-rank", "1",
              "--max-kv-tokens-per-rank", "16384", "--log-level", "warning"]


@pytest.fixture(scope="module")
def model_dir(llama_checkpoint, tmp_path_factory):
    return served_checkpoint(llama_checkpoint, tmp_path_factory, "clients_model")


@pytest.fixture(scope="module")
def server(model_dir):
    srv = ServerProcess(["--model", str(model_dir), *SERVE_ARGS])
    yield srv
    srv.close()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def offline(model_dir):
    """The same checkpoint through `LLM` offline on one rank (CP1)."""
    from cpinfer import LLM

    llm = LLM(str(model_dir), context_parallel_size=1, max_model_len=MAX_LEN, threads_per_rank=1)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def hf(model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(str(model_dir))


def _hf_prompt_logprobs(hf, ids: list[int], k: int):
    """transformers' log-softmax over the prompt: log p(ids[i] | ids[:i]) for i >= 1, and the top-k at each."""
    model, _ = hf
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()  # [L, vocab]
    lp = torch.log_softmax(logits, -1)
    chosen = lp[:-1].gather(1, torch.tensor(ids[1:])[:, None]).squeeze(1)  # [L-1]
    return chosen, torch.topk(lp[:-1], k, dim=-1)


# ---------------------------------------------------------------------------------------------- echo, scoring
def test_echo_prompt_logprobs_match_transformers_cp2(server, client, hf):
    """lm-eval's scoring request (echo, logprobs 1, max_tokens 1) and the score-only form (max_tokens 0), on a
    list of prompts (text, then token ids): one choice per prompt in order, OpenAI / vLLM's shape."""
    _, tok = hf
    texts = ["Context parallelism shards every sequence", "over ranks; the ring passes keys."]
    ids1 = tok.encode(texts[1])
    r = client.completions.create(model=NAME, prompt=texts, max_tokens=1, temperature=0, logprobs=3, echo=True)
    as_ids = client.completions.create(model=NAME, prompt=[tok.encode(t) for t in texts], max_tokens=1,
                                       temperature=0, logprobs=3, echo=True)
    assert [c.text for c in as_ids.choices] == [c.text for c in r.choices]
    assert [c.logprobs.token_logprobs for c in as_ids.choices] == [c.logprobs.token_logprobs for c in r.choices]
    assert [c.index for c in r.choices] == [0, 1]
    for choice, text in zip(r.choices, texts):
        ids = tok.encode(text)
        lp = choice.logprobs
        assert choice.text.startswith(text) and len(choice.text) > len(text) - 1
        assert lp.tokens[:len(ids)] == [tok.decode([t]) for t in ids] and len(lp.tokens) == len(ids) + 1
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        assert lp.text_offset[:3] == [0, len(lp.tokens[0]), len(lp.tokens[0]) + len(lp.tokens[1])]
        chosen, (top_vals, top_ids) = _hf_prompt_logprobs(hf, ids, 3)
        torch.testing.assert_close(torch.tensor(lp.token_logprobs[1:len(ids)]), chosen, atol=1e-4, rtol=0)
        for i, top in enumerate(lp.top_logprobs[1:len(ids)]):
            want = {tok.decode([t]): v for t, v in zip(top_ids[i].tolist(), top_vals[i].tolist())}
            assert set(top) == set(want), (i, top, want)
            torch.testing.assert_close(torch.tensor([top[k] for k in want]), torch.tensor(list(want.values())),
                                       atol=1e-4, rtol=0)
    assert r.usage.prompt_tokens == len(tok.encode(texts[0])) + len(ids1) and r.usage.completion_tokens == 2
    # score only: the prompt and its log-probabilities, no completion token
    again = client.completions.create(model=NAME, prompt=texts[0], max_tokens=0, logprobs=1, echo=True)
    c = again.choices[0]
    assert c.text == texts[0] and again.usage.completion_tokens == 0
    assert c.logprobs.token_logprobs[1:] == pytest.approx(r.choices[0].logprobs.token_logprobs[1:-1], abs=1e-5)
    # streamed, echo sends the prompt (and its log-probabilities) first, then the completion as usual
    for max_tokens in (0, 3):
        whole = client.completions.create(model=NAME, prompt=texts, max_tokens=max_tokens, logprobs=2, echo=True,
                                          temperature=0, extra_body={"ignore_eos": True})
        parts = {0: [], 1: []}
        for chunk in client.completions.create(model=NAME, prompt=texts, max_tokens=max_tokens, logprobs=2,
                                               echo=True, temperature=0, stream=True,
                                               extra_body={"ignore_eos": True}):
            parts[chunk.choices[0].index].append(chunk.choices[0])
        for i, want in enumerate(whole.choices):
            got = parts[i]
            assert "".join(c.text for c in got) == want.text and got[-1].finish_reason == want.finish_reason
            assert sum((c.logprobs.tokens for c in got), []) == want.logprobs.tokens
            assert sum((c.logprobs.token_logprobs for c in got), []) == want.logprobs.token_logprobs
            assert sum((c.logprobs.text_offset for c in got), []) == want.logprobs.text_offset
    # a cached prefix has no logits: a second scoring of the same prompt is recomputed and equal
    third = client.completions.create(model=NAME, prompt=texts[0], max_tokens=0, logprobs=1, echo=True)
    assert third.choices[0].logprobs.token_logprobs == c.logprobs.token_logprobs


def test_prompt_top_logprobs_match_transformers_cp1(offline, hf):
    """The engine's prompt log-probs with top-k at CP1 (offline), the same numbers the server returns at CP2."""
    from cpinfer import SamplingParams

    _, tok = hf
    ids = tok.encode("A prompt scored offline on one rank, with its top tokens.")
    out = offline.generate([ids], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=True,
                                                 top_logprobs=4))[0]
    chosen, (top_vals, top_ids) = _hf_prompt_logprobs(hf, ids, 4)
    assert out.prompt_logprobs[0] is None and out.prompt_top_logprobs[0] is None
    torch.testing.assert_close(torch.tensor(out.prompt_logprobs[1:]), chosen, atol=1e-4, rtol=0)
    for i, top in enumerate(out.prompt_top_logprobs[1:]):
        assert list(top) == top_ids[i].tolist()
        torch.testing.assert_close(torch.tensor(list(top.values())), top_vals[i], atol=1e-4, rtol=0)


# ---------------------------------------------------------------------------------------------- n, penalties
def _metric(server, name: str) -> float:
    text = httpx.get(server.url + "/metrics", timeout=30).text
    return sum(float(line.rpartition(" ")[2]) for line in text.splitlines() if line.startswith(name))


def test_n_samples_share_the_prefilled_prompt(server, client, hf):
    """n=3 with a seed: choice j is the request with seed+j; the prompt is prefilled once and the other two
    samples find all of it but the last token in the prefix tree."""
    _, tok = hf
    prompt = "Three independent samples of one shared, rather long prompt about rings " * 2
    n_prompt = len(tok.encode(prompt))
    hits = _metric(server, "cpinfer_prefix_cache_hits")
    r = client.completions.create(model=NAME, prompt=prompt, max_tokens=6, temperature=1.0, seed=11, n=3,
                                  extra_body={"ignore_eos": True})
    assert _metric(server, "cpinfer_prefix_cache_hits") - hits == 2 * (n_prompt - 1)
    assert [c.index for c in r.choices] == [0, 1, 2] and r.usage.completion_tokens == 18
    assert r.usage.prompt_tokens == n_prompt
    for j, choice in enumerate(r.choices):
        one = client.completions.create(model=NAME, prompt=prompt, max_tokens=6, temperature=1.0, seed=11 + j,
                                        extra_body={"ignore_eos": True})
        assert one.choices[0].text == choice.text
    assert len({c.text for c in r.choices}) > 1
    # batched prompts × n: prompt-major order; chat takes n too
    r = client.completions.create(model=NAME, prompt=["a", "b"], max_tokens=3, temperature=0, n=2,
                                  extra_body={"ignore_eos": True})
    texts = [c.text for c in r.choices]
    assert [c.index for c in r.choices] == [0, 1, 2, 3] and texts[0] == texts[1] and texts[2] == texts[3]
    for prompt, text in zip(["a", "b"], texts[::2]):
        assert client.completions.create(model=NAME, prompt=prompt, max_tokens=3, temperature=0,
                                         extra_body={"ignore_eos": True}).choices[0].text == text
    chat = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "hi"}], n=2,
                                          max_tokens=4, seed=5, extra_body={"ignore_eos": True})
    assert [c.index for c in chat.choices] == [0, 1] and chat.usage.completion_tokens == 8
    streamed = ["", ""]
    for chunk in client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "hi"}], n=2,
                                                max_tokens=4, seed=5, stream=True, extra_body={"ignore_eos": True}):
        for c in chunk.choices:
            streamed[c.index] += c.delta.content or ""
    assert streamed == [c.message.content for c in chat.choices]
    # tools with tool_choice "auto" on a model whose format cpinfer cannot tell: a 400 naming the flag
    with pytest.raises(openai.BadRequestError, match="--tool-call-parser"):
        client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                       tools=[{"type": "function", "function": {"name": "f"}}])


def test_penalties_min_p_min_tokens_through_the_sdk(offline, client):
    """The server's outputs equal the offline engine's with the same parameters (the sampler itself is checked
    against a reference in test_sampling.py); the penalties change a greedy output."""
    from cpinfer import SamplingParams

    prompt = "repeat repeat repeat repeat"
    extra = {"repetition_penalty": 1.8, "min_p": 0.05, "min_tokens": 4}
    kw = dict(max_tokens=10, presence_penalty=1.5, frequency_penalty=0.7, seed=3)
    got = {t: client.completions.create(model=NAME, prompt=prompt, temperature=t, extra_body=extra, **kw)
           for t in (0.0, 0.8)}
    plain = client.completions.create(model=NAME, prompt=prompt, max_tokens=10, temperature=0,
                                      extra_body={"ignore_eos": True})
    stream = "".join(c.choices[0].text for c in client.completions.create(
        model=NAME, prompt=prompt, temperature=0.8, stream=True, extra_body=extra, **kw))
    for t, r in got.items():
        ref = offline.generate([prompt], SamplingParams(temperature=t, **extra, **kw))[0]
        assert r.choices[0].text == ref.text and len(ref.token_ids) >= 4
    assert stream == got[0.8].choices[0].text
    # min_tokens holds EOS back: with EOS (id 2) biased to win, the output ends right after min_tokens
    for min_tokens, n_out in ((0, 1), (3, 4)):
        r = client.completions.create(model=NAME, prompt=prompt, max_tokens=8, temperature=0, logit_bias={"2": 100},
                                      extra_body={"min_tokens": min_tokens})
        assert r.usage.completion_tokens == n_out and r.choices[0].finish_reason == "stop"
    assert got[0.0].choices[0].text != plain.choices[0].text


# ---------------------------------------------------------------------------------------------- bench serve
def test_vllm_bench_serve_request_shape(server, hf):
    """What `vllm bench serve` (openai-completions backend) sends: a streamed completion with ignore_eos, a token
    budget and usage in the last chunk."""
    body = {"model": NAME, "prompt": "benchmark prompt " * 4, "temperature": 0.0, "repetition_penalty": 1.0,
            "max_tokens": 12, "logprobs": None, "best_of": 1, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": True}
    events = []
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 12
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    text = "".join(c["choices"][0]["text"] for c in chunks[:-1])
    whole = httpx.post(server.url + "/v1/completions", json={**body, "stream": False, "stream_options": None},
                       timeout=120).json()
    assert text == whole["choices"][0]["text"]


# ---------------------------------------------------------------------------------------------- lm-eval
def _lm_eval(model: str, model_args: dict, batch_size: int, tasks: Path) -> dict:
    lm_eval = pytest.importorskip("lm_eval")
    from lm_eval.tasks import TaskManager

    return lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=["cpinfer_tiny_mc", "cpinfer_tiny_gen"],
                                   task_manager=TaskManager(include_path=str(tasks)), batch_size=batch_size,
                                   log_samples=True, random_seed=0, numpy_random_seed=0, torch_random_seed=0,
                                   fewshot_random_seed=0)


def _per_sample(results: dict, task: str) -> list:
    return [s["resps"] for s in sorted(results["samples"][task], key=lambda s: s["doc_id"])]


def test_lm_eval_local_completions_agrees_with_its_hf_backend(server, model_dir, monkeypatch, tmp_path):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    for yaml in DATA.glob("*.yaml"):  # the task files name their data relative to the repository root
        (tmp_path / yaml.name).write_text(yaml.read_text().replace("tests/data/lm_eval_tiny/", f"{DATA}/"))
    api = _lm_eval("local-completions", {"model": NAME, "base_url": server.url + "/v1/completions",
                                         "tokenizer_backend": "huggingface", "tokenizer": str(model_dir),
                                         "max_retries": 1, "num_concurrent": 1, "max_length": MAX_LEN}, 4, tmp_path)
    ref = _lm_eval("hf", {"pretrained": str(model_dir), "dtype": "float32", "device": "cpu",
                          "max_length": MAX_LEN}, 4, tmp_path)
    mc_api, mc_ref = _per_sample(api, "cpinfer_tiny_mc"), _per_sample(ref, "cpinfer_tiny_mc")
    assert len(mc_api) == len(mc_ref) == 12
    worst = 0.0
    for a, b in zip(mc_api, mc_ref):  # per sample: each choice's (log-likelihood, is_greedy)
        lla, llb = torch.tensor([x[0][0] for x in a]), torch.tensor([x[0][0] for x in b])
        torch.testing.assert_close(lla, llb, atol=2e-4, rtol=0)
        assert [x[0][1] for x in a] == [x[0][1] for x in b]
        worst = max(worst, float((lla - llb).abs().max()))
    assert api["results"]["cpinfer_tiny_mc"]["acc,none"] == ref["results"]["cpinfer_tiny_mc"]["acc,none"]
    gen_api, gen_ref = _per_sample(api, "cpinfer_tiny_gen"), _per_sample(ref, "cpinfer_tiny_gen")
    assert len(gen_api) == 8 and gen_api == gen_ref
    assert (api["results"]["cpinfer_tiny_gen"]["exact_match,none"]
            == ref["results"]["cpinfer_tiny_gen"]["exact_match,none"])
    print(f"lm-eval: {len(mc_api)} mc samples x 3 choices, max |dLL| {worst:.2e}, acc "
          f"{api['results']['cpinfer_tiny_mc']['acc,none']:.4f} (cpinfer) = "
          f"{ref['results']['cpinfer_tiny_mc']['acc,none']:.4f} (hf); {len(gen_api)} generations equal: "
          f"{[g[0][0] for g in gen_api]}")
