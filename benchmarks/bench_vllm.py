"""vLLM with the oryx-vllm plugin against the project's engine (``oryx-generate``'s ``generate``) on the same
folder's weights, per schedule, in one run (docs/serving.md):

    .venv/bin/python benchmarks/bench_vllm.py [--model tiny_oryx_tg] [--batches 1 8 32] [--prompts 1024 4096]

A random model of the recipe is exported to a folder; this process times ``generate`` on the megatron model and
``benchmarks/vllm_worker.py`` times vLLM in ``.venv-vllm`` (``make .venv-vllm/.installed``) on the folder.
Rows: tokens/s of a batch (prompt --context tokens, --new-tokens generated per sequence, prefill included: the
generated tokens over the wall time) at each batch, and time to first token of one prompt at each --prompts
length (``max_tokens=1``); each the median of --repeats, ``vllm/oryx`` the ratio of the two (> 1: vLLM faster).
fp32, greedy, eager on both sides; vLLM steps its requests through the core one by one.
"""

import argparse
import dataclasses
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.bench_inference import build
from oryx_megatron.inference import generate
from oryx_megatron.interop.hf_convert import hf_config, hf_model, megatron_to_hf
from oryx_megatron.models.params import load_model_args
from oryx_megatron.parallel import initialize_parallel

SCHEDULES = ("all_attention", "all_linear", "prefill=linear decode=attention")
VLLM_PYTHON = Path(__file__).parents[1] / ".venv-vllm" / "bin" / "python"


def cases(args):
    """(metric, schedule, prompt_len, batch, new_tokens) of every row."""
    rows = [("tok/s", s, args.context, b, args.new_tokens) for s in SCHEDULES for b in args.batches]
    return rows + [("ttft_s", s, n, 1, 1) for s in SCHEDULES for n in args.prompts]


def prompts_of(prompt_len: int, batch: int):
    return [[(7 * i + j) % 200 + 1 for j in range(prompt_len)] for i in range(batch)]


def oryx_seconds(model, schedule, prompt_len, batch, new_tokens, repeats, vocab) -> float:
    prompts = prompts_of(prompt_len, batch)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        generate(model, prompts, schedule, new_tokens, vocab_size=vocab)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def vllm_seconds(folder: Path, rows, max_model_len: int, repeats: int):
    spec = {"folder": str(folder), "max_model_len": max_model_len, "repeats": repeats,
            "cases": [[schedule, prompts_of(n, batch), new] for _, schedule, n, batch, new in rows]}
    path = folder / "cases.json"
    path.write_text(json.dumps(spec))
    out = subprocess.run([str(VLLM_PYTHON), str(Path(__file__).with_name("vllm_worker.py")), str(path)],
                         capture_output=True, text=True)
    lines = [line for line in out.stdout.splitlines() if line.startswith("SECONDS ")]
    if out.returncode or not lines:
        sys.exit(f"bench_vllm: vllm_worker.py failed (exit {out.returncode}): {out.stderr[-2000:]}")
    return json.loads(lines[-1][len("SECONDS "):])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny_oryx_tg")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--prompts", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    if not VLLM_PYTHON.exists():
        sys.exit(f"bench_vllm: {VLLM_PYTHON} is missing: make .venv-vllm/.installed")
    initialize_parallel()
    torch.set_num_threads(1)
    max_model_len = max(args.prompts + [args.context]) + args.new_tokens + 1
    torch.manual_seed(0)
    model = build(args.model, max_model_len, torch.float32, "cpu")
    margs = load_model_args([f"model={args.model}"])
    margs = dataclasses.replace(margs, max_sequence_length=max(margs.max_sequence_length, max_model_len))
    rows = cases(args)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "folder"
        config = hf_config(margs)
        hf_model(config, megatron_to_hf(model.state_dict(), config)).save_pretrained(folder)
        ours = [oryx_seconds(model, *row[1:], args.repeats, margs.vocab_size) for row in rows]
        theirs = vllm_seconds(folder, rows, max_model_len, args.repeats)
    print("| metric | schedule | prompt | batch | oryx-generate | vLLM + plugin | vllm/oryx |\n|---|---|---|---|---|---|---|")
    for (metric, schedule, prompt_len, batch, new), a, b in zip(rows, ours, theirs):
        if metric == "tok/s":
            a, b = batch * new / a, batch * new / b
            ratio = b / a
        else:
            ratio = a / b
        print(f"| {metric} | {schedule} | {prompt_len} | {batch} | {a:.3g} | {b:.3g} | {ratio:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
