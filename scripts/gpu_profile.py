"""Where a GPU's time goes for the large shape of `scripts/gpu_check.sh` (Llama-3-8B, 32 layers, random bf16 weights
made on the device), one command:

    python scripts/gpu_profile.py OUT_DIR [--context 32768] [--steps 16] [--chunks 2048,32768]

For each prefill chunk size (`max_num_batched_tokens`; 2048 is the engine's default, the whole prompt is what
Hugging Face's one forward does): the TTFT of a `--context`-token prompt after a warm-up prompt of the same length,
and the device kernels of one such prefill under the PyTorch profiler on rank 0. With the first chunk size also the
decode at that context, batch 1 under CUDA graphs: the median time per token and the kernels of `--steps` steps
(the prompt's KV reused from the prefix cache, so the profile holds one 1-token prefill and the steps). Prints one
table per run and writes them, with the profiler's full tables, to OUT_DIR/gpu_profile.md. GPU_CHECK_DEVICE=cpu
runs it on the CPU at toy sizes (what the tests run).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cpinfer.bench import gpu_check as G  # noqa: E402  (after the repository is on the path)


def _generate(llm, prompt, **params):
    from cpinfer import SamplingParams

    return llm.generate([prompt], SamplingParams(temperature=0.0, ignore_eos=True, **params), use_tqdm=False)[0]


def run(out: Path, context: int, steps: int, chunks: list[int], setup: G.Setup) -> str:
    from cpinfer import LLM
    from cpinfer.bench.common import random_prompt

    cfg = dict(setup.big)
    big_dir = G.shape_dir("gpu-check-" + "-".join(str(v) for _, v in setup.big[:2]), **cfg)
    md = [f"# Profile: {setup.big_name}, {context}-token prompts, {G.device_name(setup)}", "",
          f"Versions: {G.versions()}", ""]
    for i, chunk in enumerate(chunks):
        t0 = time.perf_counter()
        llm = LLM(str(big_dir), load_format="dummy", max_model_len=context + steps + 64,
                  max_num_batched_tokens=chunk, **{**setup.engine, "enable_prefix_caching": True})
        try:
            warm, timed, prof = (random_prompt(context, cfg["vocab_size"], seed=s) for s in (11, 12, 13))
            _generate(llm, warm, max_tokens=1)
            ttft = _generate(llm, timed, max_tokens=1).metrics["ttft_s"]
            table, rows = G.profiled(llm, lambda: _generate(llm, prof, max_tokens=1), setup.device)
            head = (f"## Prefill, max_num_batched_tokens {chunk}: TTFT {ttft:.3f} s, attention "
                    f"{llm.engine.attention_backend} (engine up and runs in {time.perf_counter() - t0:.0f} s)")
            print(head, G.kernels_table(rows), sep="\n", flush=True)
            md += [head, "", G.kernels_table(rows), "", "```", table, "```", ""]
            if i == 0:
                _generate(llm, timed, max_tokens=steps)  # warm-up: the bucket's graph captured
                done = {}
                table, rows = G.profiled(llm, lambda: done.setdefault("o", _generate(llm, timed, max_tokens=steps)),
                                         setup.device)
                ttit = statistics.median(done["o"].metrics["ttit_s"][1:])
                head = (f"## Decode at {context} context, batch 1, {steps} steps: {1e3 * ttit:.2f} ms/token "
                        f"(median), one 1-token prefill beside them")
                print(head, G.kernels_table(rows), sep="\n", flush=True)
                md += [head, "", G.kernels_table(rows), "", "```", table, "```", ""]
        finally:
            llm.shutdown()
            del llm
            G._free_cuda()
        (out / "gpu_profile.md").write_text("\n".join(md))
    return "\n".join(md)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", type=Path, help="folder for gpu_profile.md (created)")
    p.add_argument("--context", type=int, default=None, help="prompt tokens (default 32768; toy: 32)")
    p.add_argument("--steps", type=int, default=16, help="decode steps profiled (default 16)")
    p.add_argument("--chunks", default=None,
                   help="prefill chunk sizes, comma-separated (default 2048,32768; toy: 16,64)")
    a = p.parse_args(argv)
    setup = G.Setup.from_env()
    context = a.context or (setup.decode_context if setup.cuda else 32)
    chunks = [int(c) for c in (a.chunks or ("2048,32768" if setup.cuda else "16,64")).split(",")]
    if min(chunks) < 1 or context < 2 or a.steps < 2:
        p.error("--chunks need positive sizes, --context at least 2 tokens, --steps at least 2")
    a.out.mkdir(parents=True, exist_ok=True)
    run(a.out, context, a.steps, chunks, setup)
    return 0


if __name__ == "__main__":
    sys.exit(main())
