"""Generation speed of a recipe's model (random weights) or a checkpoint's per schedule, context
length and batch.

    .venv/bin/python benchmarks/bench_inference.py [--model tiny_oryx_tg | --checkpoint DIR] \\
        [--contexts 256 1024] [--batches 1 4] [--new-tokens 16] [--speculative 4] [--json out.json]

For every (context, batch): all_attention (the baseline), all_linear, "prefill=linear
decode=attention", and self-speculative decoding with k = --speculative drafts (batch 1), each
with eager decode steps and (``--cuda-graphs both``, the default on CUDA) again with CUDA-graph
steps beside it. Each row: prefill seconds, decode ms per step (one token per sequence), decode
tokens/s (all sequences), its ratio to all_attention at the same context, batch and graph setting
in this run, cache memory (MB, allocated), the acceptance rate of speculative rows, and its status:
ok, eager_fallback (a CUDA-graph capture raised: the row decoded eagerly, the error beside it) or
failed (the error beside it; the other rows run on). Defaults: on CPU tiny_oryx_tg, fp32, contexts
256/1024, batches 1/4, eager only; on CUDA oryx_tg_130m, bf16, contexts 1k-64k, batches 1/8/64
(batch x context up to 2^20 tokens).
"""

import argparse
import dataclasses
import sys

import torch
from tqdm import tqdm

from oryx_megatron.eval.reporting import write_json
from oryx_megatron.inference import generate, speculative_generate
from oryx_megatron.inference.checkpoint import load_model
from oryx_megatron.models.builder import build_model, transformer_config
from oryx_megatron.models.params import load_model_args
from oryx_megatron.parallel import initialize_parallel

SCHEDULES = ("all_attention", "all_linear", "prefill=linear decode=attention")
COLUMNS = ("schedule", "graphs", "context", "batch", "prefill_s", "decode_ms_per_step", "decode_tok_per_s",
           "vs_attention", "cache_mb", "acceptance", "status")
GRAPH_SETTINGS = {"off": (False,), "on": (True,), "both": (False, True)}  # --cuda-graphs -> rows per case
DEFAULTS = {  # device type: model, dtype, contexts, batches, new tokens, max batch x context
    "cpu": ("tiny_oryx_tg", "float32", [256, 1024], [1, 4], 16, None),
    "cuda": ("oryx_tg_130m", "bfloat16", [1024, 4096, 16384, 65536], [1, 8, 64], 128, 2**20),
}


def build(recipe: str, max_length: int, dtype: torch.dtype, device: str) -> torch.nn.Module:
    """The recipe's model with random weights (seed 0), max_sequence_length raised to max_length."""
    args = load_model_args([f"model={recipe}"])
    args = dataclasses.replace(args, max_sequence_length=max(args.max_sequence_length, max_length))
    initialize_parallel()
    torch.manual_seed(0)
    model = build_model(args, transformer_config(args, params_dtype=dtype, perform_initialization=True))
    return model.to(device).eval()  # built in dtype (the SSM scalars in fp32): moved, not cast


def measure(model, schedule: str, context: int, batch: int, new_tokens: int, speculative: int,
            graphs: bool) -> dict:
    """One generate() (or speculative_generate()) of new_tokens greedy tokens after random prompts,
    decoding with CUDA-graph steps or eagerly."""
    g = torch.Generator().manual_seed(context + batch)
    prompts = torch.randint(0, model.vocab_size, (batch, context), generator=g).tolist()
    if speculative:
        result = speculative_generate(model, prompts, "all_attention", new_tokens, speculative, cuda_graphs=graphs)
    else:
        result = generate(model, prompts, schedule, new_tokens, cuda_graphs=graphs)
    stats, steps = result.stats, len(result.tokens[0]) - 1
    return dict(
        row_name(schedule, context, batch, speculative, graphs),
        prefill_s=stats.prefill_seconds,
        decode_ms_per_step=stats.decode_seconds / max(steps, 1) * 1e3,
        decode_tok_per_s=stats.decode_tokens_per_s,
        cache_mb=sum(stats.cache_bytes.values()) / 2**20,
        acceptance=stats.acceptance_rate if speculative else None,
        status="eager_fallback" if stats.capture_error else "ok",
        error=stats.capture_error,
    )


def row_name(schedule: str, context: int, batch: int, speculative: int, graphs: bool) -> dict:
    return dict(schedule=f"speculative k={speculative}" if speculative else schedule, graphs=graphs,
                context=context, batch=batch)


def measured(model, case: tuple, new_tokens: int, repeats: int) -> dict:
    """The row of one case (its fastest decode of ``repeats``), or, when it raises, a failed row with the
    error: one row's failure (a kernel, a capture, memory) costs that row alone."""
    try:
        return min((measure(model, *case[:3], new_tokens, *case[3:]) for _ in range(repeats)),
                   key=lambda r: r["decode_ms_per_step"])
    except Exception as error:
        return dict(row_name(*case), status="failed", error=f"{type(error).__name__}: {error}")


def cases(contexts, batches, speculative, max_tokens, graph_settings=(False,)):
    """(schedule, context, batch, speculative k, graphs) in table order; the baseline first in each group,
    each case eager first, then with CUDA graphs. Groups with batch x context > max_tokens are left out."""
    for context in contexts:
        for batch in batches:
            if max_tokens is not None and batch * context > max_tokens:
                continue
            spec = [("all_attention", speculative)] if speculative and batch == 1 else []
            for schedule, k in [(s, 0) for s in SCHEDULES] + spec:
                yield from ((schedule, context, batch, k, graphs) for graphs in graph_settings)


def format_table(rows) -> str:
    """Aligned plain text, one row per measurement."""
    def cell(value):
        if value is None:
            return "-"
        return f"{value:,.3f}" if isinstance(value, float) else str(value)

    cells = [list(COLUMNS)] + [[cell(row.get(c)) for c in COLUMNS] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(COLUMNS))]
    lines = ["  ".join(v.ljust(w) if i == 0 else v.rjust(w) for i, (v, w) in enumerate(zip(r, widths))) for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    lines += [f"{r['schedule']} graphs={r['graphs']} context={r['context']} batch={r['batch']}: {r['status']}: "
              f"{r['error']}" for r in rows if r.get("error")]
    return "\n".join(lines)


def main(argv=None) -> int:
    device_default = "cuda" if torch.cuda.is_available() else "cpu"
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default=device_default)
    parser.add_argument("--model", help="a recipe under recipes/model "
                                        "(default: tiny_oryx_tg on CPU, oryx_tg_130m on CUDA)")
    parser.add_argument("--checkpoint", help="a trained model (oryx-train checkpoint) instead of random weights: "
                                             "speculative acceptance then means something")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float64"))
    parser.add_argument("--contexts", type=int, nargs="+")
    parser.add_argument("--batches", type=int, nargs="+")
    parser.add_argument("--new-tokens", type=int)
    parser.add_argument("--speculative", type=int, default=4, help="drafts per round of the speculative rows (0: none)")
    parser.add_argument("--repeats", type=int, default=3, help="runs per row; the fastest decode is kept")
    parser.add_argument("--threads", type=int, default=1, help="CPU threads (tiny models run fastest on one)")
    parser.add_argument("--max-batch-tokens", type=int,
                        help="skip (context, batch) with batch x context above this (default on CUDA: 2^20)")
    parser.add_argument("--cuda-graphs", choices=GRAPH_SETTINGS,
                        help="decode steps eager (off), from CUDA graphs (on), or a row of each (both; default on "
                             "CUDA; off on CPU)")
    parser.add_argument("--json", help="also write the rows to this JSON file")
    args = parser.parse_args(argv)
    model_name, dtype, contexts, batches, new_tokens, max_tokens = DEFAULTS[torch.device(args.device).type]
    model_name, dtype = args.model or model_name, args.dtype or dtype
    contexts, batches, new_tokens = args.contexts or contexts, args.batches or batches, args.new_tokens or new_tokens

    torch.set_num_threads(args.threads)
    if args.checkpoint:
        model, run = load_model(args.checkpoint, getattr(torch, dtype))
        model, model_name = model.to(args.device), f"{run.model.family} from {args.checkpoint}"
    else:
        model = build(model_name, max(contexts) + new_tokens, getattr(torch, dtype), args.device)
    graph_settings = GRAPH_SETTINGS[args.cuda_graphs or ("both" if args.device.startswith("cuda") else "off")]
    meta = dict(model=model_name, dtype=dtype, device=args.device, new_tokens=new_tokens)
    warmup = measured(model, ("all_attention", 16, 1, 0, False), 4, 1)
    meta["warmup_error"] = warmup.get("error") if warmup["status"] == "failed" else None
    todo = list(cases(contexts, batches, args.speculative, args.max_batch_tokens or max_tokens, graph_settings))
    rows, baseline = [], {}
    for case in tqdm(todo, desc="bench_inference", file=sys.stderr):
        row = measured(model, case, new_tokens, args.repeats)
        if row["status"] != "failed":
            key = (row["context"], row["batch"], row["graphs"])
            if row["schedule"] == "all_attention":
                baseline[key] = row["decode_tok_per_s"]
            row["vs_attention"] = row["decode_tok_per_s"] / baseline[key] if key in baseline else None
        rows.append(row)
        if args.json:  # after every row: a run cut short keeps what it measured
            write_json(args.json, dict(meta, rows=rows))
    weights = "trained" if args.checkpoint else "random weights"
    print(f"model {model_name} ({weights}), {dtype}, {args.device}, {new_tokens} new tokens, greedy, "
          f"fastest of {args.repeats}; vs_attention = decode tokens/s / all_attention's at the same context, batch "
          f"and graphs")
    print(format_table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
