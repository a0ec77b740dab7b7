"""The engine's output side without ranks (cpinfer/engine/output.py): incremental detokenization equals the whole
decode (multi-byte characters split across tokens, special tokens either way), stop strings across token
boundaries, after min_tokens, and streamed text equal to the non-streamed text, on the embedded model's tokenizer."""
from __future__ import annotations

import random

import pytest

from cpinfer.engine.batch import SampleResult
from cpinfer.engine.output import Detokenizer, OutputProcessor
from cpinfer.engine.request import Request
from cpinfer.engine.sampling import SamplingParams
from cpinfer.model.resolve import resolve_model
from cpinfer.server.outputs import Progress

TEXT = (" fox is a classic example of a pun, where a word 🙂 or phrase is used in a clever way — naïve café, "
        "日本語のテキスト, 🦜 and 👩‍👩‍👧 emoji.")


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(resolve_model(None)))


def _run(tok, tokens: list[int], eos=(), **params):
    """Feed `tokens` as sampled tokens; the outputs after each one (stops at the finish)."""
    proc = OutputProcessor(tok, eos, {"prompt_tokens": 0, "generation_tokens": 0})
    req = Request("r", [1, 2, 3], SamplingParams(**params), seed=0)
    outs = []
    for t in tokens:
        proc.take_token(req, SampleResult(0, t, -0.5, ()), 1.0, {})
        outs.append(proc.output(req))
        if req.finish_reason is not None:
            break
    return outs


def _streamed(outs) -> str:
    progress, text = Progress(), ""
    for o in outs:
        delta, _ = progress.advance(o)
        text += delta
    return text


def test_incremental_detokenizer_equals_whole_decode(tok):
    rng = random.Random(0)
    specials = sorted(tok.all_special_ids)
    cases = [tok.encode(TEXT), tok.encode(TEXT * 3)]
    cases += [[rng.randrange(tok.vocab_size) for _ in range(200)] for _ in range(6)]  # broken UTF-8 everywhere
    cases += [tok.encode("a 🙂 b") + [specials[0]] + tok.encode(" café 日本") + [specials[-1]] + tok.encode("!")]
    for ids in cases:
        for skip in (True, False):
            d = Detokenizer(tok, skip)
            text = "".join(d.add(t) for t in ids) + d.flush()
            assert text == tok.decode(ids, skip_special_tokens=skip)
    # a multi-byte character split over tokens is held back, never sent as U+FFFD
    parrot = tok.encode("🦜")
    assert len(parrot) == 3  # one character, three tokens
    d = Detokenizer(tok, True)
    assert [d.add(t) for t in parrot] == ["", "", "🦜"]


def test_outputs_grow_like_the_whole_decode(tok):
    ids = tok.encode(TEXT)
    outs = _run(tok, ids, max_tokens=len(ids))
    assert outs[-1].finish_reason == "length" and outs[-1].text == tok.decode(ids, skip_special_tokens=True)
    for o in outs:
        assert "\ufffd" not in o.text and tok.decode(ids, skip_special_tokens=True).startswith(o.text)
    assert _streamed(outs) == outs[-1].text


def _stop_grid(tok, ids):
    """Stop strings of 1-3 tokens' text: at the start, inside a token, across token boundaries, multi-byte."""
    full = tok.decode(ids)
    pieces = [tok.decode(ids[:i]) for i in range(len(ids) + 1)]
    stops = {full[:3], full[1:4], "classic example", " a pun, where", "phrase is used", "🙂", "word 🙂 o", "é, 日", "🦜", " 🦜 a",
             "ïve", "— na", "emoji.", "not in the text", pieces[5][-2:] + full[len(pieces[5]):len(pieces[5]) + 2]}
    return full, sorted(stops)


@pytest.mark.parametrize("min_tokens", [0, 1, 3, 10])
@pytest.mark.parametrize("include", [False, True])
def test_stop_strings_streamed_equal_non_streamed(tok, min_tokens, include):
    ids = tok.encode(TEXT)
    full, stops = _stop_grid(tok, ids)
    for stop in stops:
        outs = _run(tok, ids, max_tokens=len(ids), stop=[stop], min_tokens=min_tokens,
                    include_stop_str_in_output=include)
        last = outs[-1]
        protected = len(tok.decode(ids[:min_tokens]))  # stop strings are looked for after the first min_tokens
        at = full.find(stop, protected)
        if at < 0:
            assert last.finish_reason == "length" and last.text == full and last.stop_reason is None, stop
        else:
            want = full[:at + len(stop)] if include else full[:at]
            n = next(i for i in range(len(ids) + 1) if tok.decode(ids[:i]).find(stop, protected) >= 0)
            assert (last.finish_reason, last.stop_reason, last.text) == ("stop", stop, want), stop
            assert len(last.token_ids) == n, stop
        assert _streamed(outs) == last.text, stop  # nothing sent that is taken back
        for o in outs[:-1]:
            assert last.text.startswith(o.text), stop


def test_stop_tokens_eos_and_min_tokens(tok):
    ids = tok.encode(TEXT)
    eos = ids[4]
    outs = _run(tok, ids, eos=(eos,), max_tokens=50)
    assert outs[-1].finish_reason == "stop" and outs[-1].stop_reason is None and len(outs[-1].token_ids) == 5
    assert outs[-1].text == tok.decode(ids[:4])  # the EOS token's own text is left out
    outs = _run(tok, ids, eos=(eos,), max_tokens=50, include_stop_str_in_output=True)
    assert outs[-1].text == tok.decode(ids[:5])
    outs = _run(tok, ids, max_tokens=50, stop_token_ids=[ids[2]])
    assert (outs[-1].stop_reason, outs[-1].text) == (ids[2], tok.decode(ids[:2]))
    # a stop token inside the first min_tokens tokens does not end the output (the sampler suppresses it there)
    outs = _run(tok, ids, max_tokens=len(ids), stop_token_ids=[ids[2]], min_tokens=4)
    later = [j + 1 for j in range(3, len(ids)) if ids[j] == ids[2]]
    assert len(outs[-1].token_ids) == (later[0] if later else len(ids)) > 3
    outs = _run(tok, ids, max_tokens=len(ids), ignore_eos=True, eos=(eos,))
    assert outs[-1].finish_reason == "length" and outs[-1].text == tok.decode(ids)


def test_stop_strings_over_broken_utf8(tmp_path):
    """Random bytes (a byte-level tokenizer): held-back partial characters are flushed by the last token, so a stop
    string holding U+FFFD is found where the whole decode has it, and the streamed text equals the final one."""
    from transformers import AutoTokenizer

    from server_utils import write_tiny_tokenizer

    tiny = AutoTokenizer.from_pretrained(str(write_tiny_tokenizer(tmp_path)))
    rng = random.Random(1)
    for _ in range(40):
        ids = [rng.randrange(3, 259) for _ in range(12)]  # the 256 byte tokens
        full = tiny.decode(ids, skip_special_tokens=True)
        for stop in {full[len(full) // 2:len(full) // 2 + 2], full[-1:], full[:1]}:
            outs = _run(tiny, ids, max_tokens=len(ids), stop=[stop])
            assert (outs[-1].finish_reason, outs[-1].text) == ("stop", full[:full.index(stop)]), (ids, stop)
            assert _streamed(outs) == outs[-1].text
