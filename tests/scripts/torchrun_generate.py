"""Run under torchrun: every process calls LLM(...) (rank 0 drives, the others serve); rank 0 writes tokens."""
import json
import sys

from cpinfer import LLM, SamplingParams


def main(model: str, cp: int, tp: int, out: str) -> None:
    llm = LLM(model, context_parallel_size=cp, tensor_parallel_size=tp, threads_per_rank=1, timeout_s=120)
    prompt = list(range(3, 83))
    first = llm.generate([prompt], SamplingParams(max_tokens=6, temperature=0, logprobs=True, ignore_eos=True))[0]
    second = llm.generate([prompt + first.token_ids + [9, 10]],
                          SamplingParams(max_tokens=6, temperature=0, logprobs=True, ignore_eos=True))[0]
    llm.shutdown()
    with open(out, "w") as f:
        json.dump({"first": first.token_ids, "second": second.token_ids, "cached": second.num_cached_tokens,
                   "logprobs": first.logprobs + second.logprobs}, f)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
