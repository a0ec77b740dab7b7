"""The engine on real weights — SmolLM2-135M-Instruct from its GGUF (fp32, CPU, gloo) — against `transformers`
loading the same GGUF: prompt log-probs over a >1K-token real document, 32 greedy tokens, a 2-turn chat whose
second turn reuses the first turn's KV, and the chat template, at CP 1, 2 and 3.
"""
from pathlib import Path

import pytest
import torch
import transformers

from cpinfer import LLM, SamplingParams
from cpinfer.model.resolve import default_model_file, resolve_model

DOC_TOKENS = 1100          # the document's length; the chat prompt adds the template and the question
STEPS = 32                 # greedy tokens of the long request
TURN_STEPS = 16            # tokens per chat answer at most (decode steps are what CP3 on 2 cores pays most for)
ATOL = 1e-4
Q1 = "In one sentence: what does cpinfer do?"
Q2 = "Which two ring variants does it choose between?"
REPO = Path(__file__).resolve().parents[1]


class HFOracle:
    """transformers' LlamaForCausalLM and tokenizer read from the GGUF file itself (fp32, eager attention)."""

    def __init__(self, gguf: Path):
        transformers.utils.logging.disable_progress_bar()
        transformers.utils.logging.set_verbosity_error()
        kw = dict(gguf_file=gguf.name)
        self.tok = transformers.AutoTokenizer.from_pretrained(str(gguf.parent), **kw)
        self.model = transformers.LlamaForCausalLM.from_pretrained(
            str(gguf.parent), dtype=torch.float32, attn_implementation="eager", **kw).eval()
        self.eos = self.model.config.eos_token_id

    def chat_ids(self, messages: list[dict]) -> list[int]:
        ids = self.tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)

    @torch.no_grad()
    def greedy(self, prompt: list[int], steps: int, stop_at_eos: bool, history=None):
        """(prompt log-probs [len-1], greedy tokens, their log-probs, (the tokens in HF's KV cache, that cache)),
        decoding with HF's own KV cache. `history` = (tokens, cache) of an earlier call: the K/V of its longest
        common prefix with `prompt` are reused (as the engine reuses a chat's first turn) and only the rest is
        computed; then the prompt log-probs cover the computed part only."""
        start, past = 0, None
        if history is not None:
            seen, past = history
            while start < min(len(seen), len(prompt) - 1) and seen[start] == prompt[start]:
                start += 1
            assert past.get_seq_length() == len(seen)
            if start < len(seen):
                past.crop(start - len(seen))  # (this transformers takes how many tokens to drop, as a negative)
        out = self.model(torch.tensor([prompt[start:]]), past_key_values=past, use_cache=True)
        lp = out.logits[0].float().log_softmax(-1)                                  # [P - start, vocab]
        prompt_lp = lp[torch.arange(len(prompt) - start - 1), torch.tensor(prompt[start + 1:])]
        last, past, tokens, lps = lp[-1], out.past_key_values, [], []
        for _ in range(steps):
            t = int(last.argmax())
            tokens.append(t)
            lps.append(float(last[t]))
            if stop_at_eos and t == self.eos:
                break
            out = self.model(torch.tensor([[t]]), past_key_values=past, use_cache=True)
            last, past = out.logits[0, -1].float().log_softmax(-1), out.past_key_values
        fed = tokens if not (stop_at_eos and tokens and tokens[-1] == self.eos) else tokens[:-1]
        return prompt_lp, tokens, torch.tensor(lps), (list(prompt) + fed, past)


def _document(tok) -> str:
    """DOC_TOKENS tokens of the project's own README and docs, as text."""
    files = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    text = "\n\n".join(f.read_text() for f in files if f.is_file())
    ids = tok(text)["input_ids"]
    assert len(ids) >= DOC_TOKENS, f"the repository's docs have only {len(ids)} tokens"
    return tok.decode(ids[:DOC_TOKENS])


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return resolve_model(None)


@pytest.fixture(scope="module")
def ref():
    """Everything the engine is compared with, computed once by transformers (one thread: on a busy 2-core
    machine more threads than free cores slow torch down several times)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _reference()
    finally:
        torch.set_num_threads(threads)


def _reference() -> dict:
    hf = HFOracle(default_model_file())
    doc = _document(hf.tok)
    turn1 = [{"role": "user", "content": f"{doc}\n\n{Q1}"}]
    p1 = hf.chat_ids(turn1)
    prompt_lp, tokens, lps, history = hf.greedy(p1, STEPS, stop_at_eos=False)
    answer = tokens[:TURN_STEPS]
    answer = answer[:answer.index(hf.eos) + 1] if hf.eos in answer else answer
    turn2 = turn1 + [{"role": "assistant", "content": hf.tok.decode(answer, skip_special_tokens=True)},
                     {"role": "user", "content": Q2}]
    p2 = hf.chat_ids(turn2)
    _, tokens2, lps2, _ = hf.greedy(p2, TURN_STEPS, stop_at_eos=True, history=history)  # turn 1's K/V reused
    return dict(hf=hf, turn1=turn1, turn2=turn2, p1=p1, p2=p2, prompt_lp=prompt_lp, tokens=tokens, lps=lps,
                answer=answer, tokens2=tokens2, lps2=lps2)


@pytest.fixture(scope="module", params=[1, 2, 3], ids=lambda n: f"cp{n}")
def runs(request, model_dir, ref):
    """One LLM per CP size; every request of the module runs in it once. The model is named the three ways
    `LLM` accepts it: nothing (the embedded default), the GGUF file, the converted folder."""
    cp = request.param
    model = {1: None, 2: str(default_model_file()), 3: str(model_dir)}[cp]
    greedy = dict(temperature=0.0, logprobs=True)
    placement = "shard" if cp == 3 else "auto"  # CP3: every sequence in the ring; CP2: the cost model decides
    with LLM(model, context_parallel_size=cp, max_kv_tokens_per_rank=4096, threads_per_rank=1,
             timeout_s=300, placement=placement) as llm:
        long = llm.generate([ref["p1"]], SamplingParams(max_tokens=STEPS, prompt_logprobs=True,
                                                          ignore_eos=True, **greedy))[0]
        t1 = llm.chat(ref["turn1"], SamplingParams(max_tokens=TURN_STEPS, **greedy))[0]
        t2 = llm.chat(ref["turn2"], SamplingParams(max_tokens=TURN_STEPS, **greedy))[0]
        with pytest.raises(ValueError, match=r"8192"):
            llm.generate([[1] * 8000], SamplingParams(max_tokens=200))
    return dict(cp=cp, long=long, t1=t1, t2=t2)


def test_converted_weights_equal_transformers_dequantization(model_dir, ref):
    from safetensors.torch import load_file

    ours = load_file(str(model_dir / "model.safetensors"))
    theirs = ref["hf"].model.state_dict()
    assert set(theirs) - set(ours) == {"lm_head.weight"}  # tied: HF lists the shared tensor twice
    for name, w in ours.items():
        torch.testing.assert_close(w, theirs[name], rtol=0, atol=0, msg=name)


def test_real_checkpoint_shape(model_dir):
    from cpinfer.model.config import ModelConfig

    c = ModelConfig.from_pretrained(model_dir)
    assert (c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (30, 9, 3, 64)
    assert c.tie_word_embeddings and c.rope_theta == 100000.0 and c.max_position_embeddings == 8192
    assert (c.bos_token_id, c.eos_token_ids) == (1, (2,))
    assert c.rms_norm_eps == pytest.approx(1e-5)


def test_tokenizer_and_chat_template_equal_transformers(model_dir, ref):
    ours = transformers.AutoTokenizer.from_pretrained(str(model_dir))
    text = (REPO / "README.md").read_text()
    assert ours(text)["input_ids"] == ref["hf"].tok(text)["input_ids"]
    for msgs in (ref["turn1"], ref["turn2"]):
        got = ours.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
        assert list(got["input_ids"] if hasattr(got, "keys") else got) == ref["hf"].chat_ids(msgs)


def test_prompt_logprobs_match_hf(runs, ref):
    out = runs["long"]
    assert len(ref["p1"]) > 1000 and out.prompt_token_ids == ref["p1"]
    assert out.prompt_logprobs[0] is None
    torch.testing.assert_close(torch.tensor(out.prompt_logprobs[1:]), ref["prompt_lp"], atol=ATOL, rtol=0)


def test_32_greedy_tokens_match_hf(runs, ref):
    out = runs["long"]
    assert out.token_ids == ref["tokens"]
    torch.testing.assert_close(torch.tensor(out.logprobs), ref["lps"], atol=ATOL, rtol=0)


def test_chat_template_applied_as_transformers(runs, ref):
    assert runs["t1"].prompt_token_ids == ref["p1"]
    assert runs["t2"].prompt_token_ids == ref["p2"]
    assert ref["p2"][:len(ref["p1"]) + len(ref["answer"])] == ref["p1"] + ref["answer"]  # turn 2 extends turn 1


def test_two_turn_chat_reuses_kv_and_matches_hf(runs, ref):
    t1, t2 = runs["t1"], runs["t2"]
    assert t1.token_ids == ref["answer"]
    assert t2.num_cached_tokens >= len(ref["p1"])  # the document's K/V is not recomputed in turn 2
    assert t2.token_ids == ref["tokens2"]
    torch.testing.assert_close(torch.tensor(t2.logprobs), ref["lps2"], atol=ATOL, rtol=0)
