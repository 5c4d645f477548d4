"""vLLM serving an Oryx folder through the oryx-vllm plugin, against the project's engine (``oryx-generate``'s
``generate``) on the same weights and against vLLM's own ``LlamaForCausalLM`` serving the Transformer baseline's
stock-Llama folder of the same width and depth, in one run (docs/serving.md):

    .venv/bin/python -m benchmarks.bench_vllm [--model tiny_oryx_tg] [--baseline tiny_transformer] [--check]

Random models of both recipes are exported to folders; this process times ``generate`` on the megatron model and
``benchmarks/vllm_worker.py`` serves each folder with ``oryx-vllm serve`` in ``.venv-vllm`` (``make
.venv-vllm/.installed``) and measures it through the HTTP server with concurrent clients. Rows: tokens/s of
--batches concurrent requests (a --context-token prompt, --new-tokens generated each, prefill included: the
generated tokens over the wall time); time to first token of one prompt at each --prompts length
(``max_tokens=1``); seconds of a decode step of --step-clients concurrent requests at each --step-contexts
context (their streamed tokens' spacing). Each the median of --repeats; ratios > 1: the plugin better. FLOPs per
token (``oryx_megatron.models.flops``, forward: a third of a training step's, averaged over the sequence) beside
the Llama's: an Oryx layer updates two memories per token. ``--check`` exits 1 when a target (TARGETS) is missed.
fp32, greedy, eager on every side.
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
from oryx_megatron.models import flops
from oryx_megatron.models.params import load_model_args
from oryx_megatron.parallel import initialize_parallel

SCHEDULES = ("all_attention", "all_linear", "prefill=linear decode=attention")
VLLM_PYTHON = Path(__file__).parents[1] / ".venv-vllm" / "bin" / "python"
# (metric, batches it binds at, ratio column, least ratio) -- docs/serving.md; ttft: today's worst (0.73)
TARGETS = [("tok/s", (8, 32), "plugin/oryx", 1.0), ("tok/s", (1, 8, 32), "plugin/llama", 0.7),
           ("ttft_s", (1,), "plugin/oryx", 0.73)]
# all_linear's decode step at the longest --step-contexts: within 1.1x of its own at the shortest, and 2x the Llama's
LINEAR_FLAT, LINEAR_OVER_LLAMA = 1.1, 2.0


@dataclasses.dataclass
class Row:
    metric: str  # tok/s, ttft_s, step_s
    schedule: str
    prompt: int
    batch: int
    new_tokens: int
    oryx: float = None  # seconds
    plugin: float = None
    llama: float = None


def rows_of(args):
    rows = [Row("tok/s", s, args.context, b, args.new_tokens) for s in SCHEDULES for b in args.batches]
    rows += [Row("ttft_s", s, n, 1, 1) for s in SCHEDULES for n in args.prompts]
    return rows + [Row("step_s", "all_linear", n, args.step_clients, args.step_tokens) for n in args.step_contexts]


def prompts_of(prompt_len: int, batch: int):
    return [[(7 * i + j) % 200 + 1 for j in range(prompt_len)] for i in range(batch)]


def oryx_seconds(model, row: Row, repeats: int, vocab: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        generate(model, prompts_of(row.prompt, row.batch), row.schedule, row.new_tokens, vocab_size=vocab)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def vllm_seconds(folders: dict, rows, max_model_len: int, repeats: int) -> None:
    """Fills each row's plugin and llama seconds, measured by vllm_worker.py (the Llama once per prompt, batch and
    metric: it has no schedule; none for time to first token)."""
    cases, llama = [], {}
    for row in rows:
        kind = "step" if row.metric == "step_s" else "wall"
        cases.append(["oryx", kind, row.schedule, prompts_of(row.prompt, row.batch), row.new_tokens])
        key = (kind, row.prompt, row.batch, row.new_tokens)
        if row.metric != "ttft_s" and key not in llama:
            llama[key] = len(cases)
            cases.append(["llama", kind, None, prompts_of(row.prompt, row.batch), row.new_tokens])
    spec = {"servers": {k: str(v) for k, v in folders.items()}, "max_model_len": max_model_len, "repeats": repeats,
            "cases": cases}
    path = folders["oryx"].parent / "cases.json"
    path.write_text(json.dumps(spec))
    out = subprocess.run([str(VLLM_PYTHON), str(Path(__file__).with_name("vllm_worker.py")), str(path)],
                         capture_output=True, text=True)
    lines = [line for line in out.stdout.splitlines() if line.startswith("SECONDS ")]
    if out.returncode or not lines:
        sys.exit(f"bench_vllm: vllm_worker.py failed (exit {out.returncode}): {out.stderr[-2000:]}")
    seconds = json.loads(lines[-1][len("SECONDS "):])
    plugin = iter(s for case, s in zip(cases, seconds) if case[0] == "oryx")
    for row in rows:
        row.plugin = next(plugin)
        key = ("step" if row.metric == "step_s" else "wall", row.prompt, row.batch, row.new_tokens)
        row.llama = seconds[llama[key]] if key in llama else None


def export(recipe: str, max_model_len: int, folder: Path):
    """The recipe's random model (seed 0) and its folder; the model's args."""
    model = build(recipe, max_model_len, torch.float32, "cpu")
    margs = load_model_args([f"model={recipe}"])
    margs = dataclasses.replace(margs, max_sequence_length=max(margs.max_sequence_length, max_model_len))
    config = hf_config(margs)
    hf_model(config, megatron_to_hf(model.state_dict(), config)).save_pretrained(folder)
    return model, margs


def flops_per_token(model, schedule: str, prompt: int, new_tokens: int) -> float:
    """Forward FLOPs per token of one sequence of prompt + new_tokens under ``schedule`` (a third of a training
    step's: forward only), the fraction of positions reading attention from the schedule's modes."""
    read = {"all_attention": 1.0, "all_linear": 0.0}.get(schedule, new_tokens / (prompt + new_tokens))
    seq = prompt + new_tokens
    shape = flops.step_shape(model.config, flops.matmul_params(model), seq, 1, read)
    return flops.train_step_flops(shape) / 3 / seq


def ratios(row: Row) -> dict:
    """plugin/oryx and plugin/llama, > 1: the plugin better (more tokens/s, less time)."""
    if row.metric == "tok/s":
        per_s = {k: row.batch * row.new_tokens / v for k, v in (("o", row.oryx), ("p", row.plugin), ("l", row.llama))
                 if v is not None}
        return {"plugin/oryx": per_s["p"] / per_s["o"], "plugin/llama": per_s["p"] / per_s["l"]}
    out = {}
    if row.oryx is not None:
        out["plugin/oryx"] = row.oryx / row.plugin
    if row.llama is not None:
        out["plugin/llama"] = row.llama / row.plugin
    return out


def missed(rows) -> list:
    """The targets missed, one line each."""
    lines = []
    for row in rows:
        for metric, batches, column, least in TARGETS:
            value = ratios(row).get(column) if row.metric == metric and row.batch in batches else None
            if value is not None and value < least:
                lines.append(f"{metric} {row.schedule} prompt {row.prompt} batch {row.batch}: {column} "
                             f"{value:.2f} < {least}")
    steps = [row for row in rows if row.metric == "step_s"]
    if steps and ratios(steps[-1])["plugin/llama"] < LINEAR_OVER_LLAMA:
        lines.append(f"step_s all_linear at {steps[-1].prompt} tokens: plugin/llama "
                     f"{ratios(steps[-1])['plugin/llama']:.2f} < {LINEAR_OVER_LLAMA}")
    if len(steps) > 1 and steps[-1].plugin > LINEAR_FLAT * steps[0].plugin:
        lines.append(f"step_s all_linear: {steps[-1].plugin:.4f} s at {steps[-1].prompt} tokens > {LINEAR_FLAT}x "
                     f"{steps[0].plugin:.4f} s at {steps[0].prompt}")
    return lines


def table(rows) -> str:
    def cell(v):
        return "-" if v is None else f"{v:.3g}"

    lines = ["| metric | schedule | prompt | batch | oryx-generate | vLLM + plugin | vLLM Llama | plugin/oryx | "
             "plugin/llama |", "|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        values = [row.oryx, row.plugin, row.llama]
        if row.metric == "tok/s":
            values = [None if v is None else row.batch * row.new_tokens / v for v in values]
        r = ratios(row)
        lines.append(f"| {row.metric} | {row.schedule} | {row.prompt} | {row.batch} | "
                     + " | ".join(cell(v) for v in values) + f" | {cell(r.get('plugin/oryx'))} | "
                     f"{cell(r.get('plugin/llama'))} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny_oryx_tg")
    parser.add_argument("--baseline", default=None, help="the Transformer recipe (default: --model's, its family "
                        "replaced by transformer: tiny_oryx_tg -> tiny_transformer)")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--prompts", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--step-contexts", type=int, nargs="+", default=[500, 6000], help="ascending")
    parser.add_argument("--step-clients", type=int, default=4)
    parser.add_argument("--step-tokens", type=int, default=65)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--check", action="store_true", help="exit 1 when a target is missed")
    args = parser.parse_args(argv)
    if not VLLM_PYTHON.exists():
        sys.exit(f"bench_vllm: {VLLM_PYTHON} is missing: make .venv-vllm/.installed")
    initialize_parallel()
    torch.set_num_threads(1)
    family = load_model_args([f"model={args.model}"]).family
    baseline = args.baseline or args.model.replace(family, "transformer")
    max_model_len = max(args.prompts + [args.context] + args.step_contexts) + max(args.new_tokens, args.step_tokens)
    rows = rows_of(args)
    with tempfile.TemporaryDirectory() as tmp:
        folders = {"oryx": Path(tmp) / "oryx", "llama": Path(tmp) / "llama"}
        torch.manual_seed(0)
        model, margs = export(args.model, max_model_len, folders["oryx"])
        llama, _ = export(baseline, max_model_len, folders["llama"])
        for row in rows:
            if row.metric != "step_s":
                row.oryx = oryx_seconds(model, row, args.repeats, margs.vocab_size)
        vllm_seconds(folders, rows, max_model_len, args.repeats)
    print(f"{args.model} against vLLM's Llama of {baseline}; forward FLOPs per token at a {args.context}-token "
          f"prompt + {args.new_tokens}: " + ", ".join(
              f"{s} {flops_per_token(model, s, args.context, args.new_tokens):.3g}" for s in SCHEDULES)
          + f"; Llama {flops_per_token(llama, 'all_attention', args.context, args.new_tokens):.3g}")
    print(table(rows))
    lines = missed(rows)
    for line in lines:
        print(f"missed: {line}")
    return 1 if args.check and lines else 0


if __name__ == "__main__":
    sys.exit(main())
