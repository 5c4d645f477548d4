"""Training-step benchmark: every model family at one recipe shape, in one table.

    # CPU toy run (fp32, ~15 s on 2 cores)
    .venv/bin/python benchmarks/bench_train_step.py --model-size tiny --seq 256 --micro-batch 2 --repeats 2
    # one H100/H200 (bf16), the issue's shapes
    python benchmarks/bench_train_step.py --model-size 130m --seq 2048 --micro-batch 8 \\
        --p-attention 1.0 0.5 0.1 --recompute none selective full --json bench_130m.json

Rows: the Transformer baseline (megatron's GPTModel, local spec with SDPA core attention),
an attention-only Oryx layer stack (the oryx_tg recipe with ``mixers="attention"``),
Oryx-TM and Oryx-TG (one row per ``--p-attention``: modes per chunk of ``--chunk`` tokens,
``random_chunks`` of ``oryx_megatron.data.modes`` drawn with seed 0), Mamba-2 and GDN; each
once per ``--recompute`` setting (megatron's ``recompute_granularity``: none, selective, full);
with ``--reset-at-eod`` each row also on packed documents read each alone (``document_ids`` of a
log-normal length mix, median seq / 8 tokens: ``packed_documents``; the "docs" column gives the
documents per sample and "reset vs across" the step time against the same row without resets).

A step is one training iteration on one micro-batch: forward with the LM loss (mean over tokens),
backward, ``torch.optim.AdamW`` step (fused on CUDA; bf16 parameters on CUDA, fp32 on CPU, no fp32
master copy) and zeroing the gradients. Time: median over ``--repeats`` steps after ``--warmup``,
synchronized on CUDA. Memory: ``torch.cuda.max_memory_allocated`` (weights, gradients, AdamW state,
activations; "n/a" on CPU). "act GiB" (every device): what one forward with the loss still holds when
it ends, what recomputation trades for time (CUDA: the allocator; CPU: torch.profiler's memory events).
"vs transformer": step time / the Transformer's at the same recompute setting in the same run; "act
vs none" and "time vs none": a recompute row against its ``none`` row.

FLOPs of one step: ``oryx_megatron.models.flops`` (the training log's MFU counts the same; its
docstring has the formula and docs/performance.md the reasons). MFU = FLOPs / step time /
(``--peak-tflops`` * 1e12); the default peak is 989 TFLOP/s (H100 / H200 dense bf16) when the CUDA
device's name says H100 or H200, otherwise MFU is "n/a" unless ``--peak-tflops`` is given.
"""

import argparse
import dataclasses
import datetime
import gc
import statistics
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

import torch
from tqdm import tqdm

from oryx_megatron.config import FAMILY_MIXERS, Mode, ModelArgs
from oryx_megatron.data.modes import RandomChunks
from oryx_megatron.eval.reporting import write_json
from oryx_megatron.models import flops
from oryx_megatron.models.builder import build_model, transformer_config
from oryx_megatron.models.params import load_model_args
from oryx_megatron.parallel import current_device, destroy_parallel, initialize_parallel

MODEL_SIZES = {"tiny": "tiny_{family}", "130m": "{family}_130m", "1_4b": "{family}_1_4b"}  # recipes/model/
RECOMPUTE = {  # --recompute -> TransformerConfig fields
    "none": {},
    "selective": dict(recompute_granularity="selective"),  # megatron's default modules: core_attn
    "full": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
}
H100_H200_BF16_TFLOPS = 989.0  # dense bf16 peak of one H100 / H200 SXM


@dataclasses.dataclass(frozen=True)
class Variant:
    """One model of the table: a recipe family, optionally with other mixers."""

    name: str
    family: str
    mixers: Optional[str] = None  # replaces the family's mixers

    @property
    def reads_modes(self) -> bool:
        """Multi-mixer: one row per --p-attention."""
        return "+" in (self.mixers or FAMILY_MIXERS[self.family] or "")


VARIANTS = (
    Variant("transformer", "transformer"),  # the baseline: first, always measured
    Variant("attn_only_oryx", "oryx_tg", mixers="attention"),
    Variant("oryx_tm", "oryx_tm"),
    Variant("oryx_tg", "oryx_tg"),
    Variant("mamba2", "mamba2"),
    Variant("gdn", "gdn"),
)
BASELINE = VARIANTS[0]


@dataclasses.dataclass(frozen=True)
class Bench:
    """Everything that is the same for every row."""

    size: str
    shape_overrides: Dict[str, int]  # ModelArgs fields from --layers / --hidden / --heads
    kernel_backend: Optional[str]
    seq: int
    micro_batch: int
    chunk: int
    warmup: int
    repeats: int
    device: torch.device
    dtype: torch.dtype
    peak_tflops: Optional[float]
    profile_dir: Optional[Path] = None  # --profile: one profiled step per row


def recipe_args(bench: Bench, family: str) -> ModelArgs:
    """The family's recipe at --model-size, with the explicit shape flags and --seq applied.

    --hidden scales the MLP width with it, keeping each family's parameter-matched ratio;
    --hidden or --heads sets d_k = d_v = hidden / heads."""
    args = load_model_args([f"model={MODEL_SIZES[bench.size].format(family=family)}"])
    fields = dict(bench.shape_overrides, max_sequence_length=max(args.max_sequence_length, bench.seq))
    if "hidden_size" in fields or "num_attention_heads" in fields:
        hidden = fields.get("hidden_size", args.hidden_size)
        head_dim = hidden // fields.get("num_attention_heads", args.num_attention_heads)
        fields.update(kv_channels=head_dim, value_head_dim=head_dim,
                      ffn_hidden_size=args.ffn_hidden_size * hidden // args.hidden_size)
    if bench.kernel_backend is not None:
        fields["kernel_backend"] = bench.kernel_backend
    return dataclasses.replace(args, **fields)


def build(bench: Bench, variant: Variant, recompute: str):
    """(model on the device in the run's dtype, its config)."""
    args = recipe_args(bench, variant.family)
    config = transformer_config(
        args, params_dtype=bench.dtype, bf16=bench.dtype == torch.bfloat16,
        gradient_accumulation_fusion=False,  # needs megatron DDP's main_grad; plain AdamW here
        **RECOMPUTE[recompute],
    )
    if variant.mixers is not None:
        config = dataclasses.replace(config, mixers=variant.mixers)
    torch.manual_seed(0)
    model = build_model(args, config).to(bench.device)  # built in the run's dtype (SSM scalars fp32): moved, not cast
    return model, config


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_step_seconds(step: Callable[[], None], bench: Bench) -> float:
    for _ in range(bench.warmup):
        step()
    times = []
    for _ in range(bench.repeats):
        synchronize(bench.device)
        start = time.perf_counter()
        step()
        synchronize(bench.device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def packed_documents(micro_batch: int, seq: int, seed: int = 0) -> torch.Tensor:
    """document_ids [micro_batch, seq] of packed documents of a heavy-tailed length mix: lengths
    log-normal around a median of seq / 8 tokens (256 at 2048; sigma 1), the last cut by the sample's
    end, as pretraining packs a web corpus."""
    g = torch.Generator().manual_seed(seed)
    lengths = (torch.randn(micro_batch, seq, generator=g) + torch.tensor(seq / 8).log()).exp().ceil().long()
    ends = lengths.cumsum(1)  # [b, seq] document ends; more than enough documents
    starts = torch.zeros(micro_batch, seq + 1, dtype=torch.long).scatter_(1, ends.clamp(max=seq), 1)
    return starts[:, :seq].cumsum(1)


def measure(bench: Bench, variant: Variant, p_attention: Optional[float], recompute: str,
            reset_at_eod: bool = False) -> dict:
    """One row: build the model, time its training step, count its FLOPs."""
    row = dict(model=variant.name, p_attention=p_attention, recompute=recompute, reset_at_eod=reset_at_eod)
    try:
        model, config = build(bench, variant, recompute)
    except Exception as error:  # e.g. a recompute granularity the layer does not offer yet
        return dict(row, status="unsupported", error=f"{type(error).__name__}: {error}")
    modes = None if p_attention is None else RandomChunks(chunk_size=bench.chunk, p_attention=p_attention).batch(
        bench.seq, range(bench.micro_batch), seed=0).to(bench.device)
    read = 1.0 if modes is None else (modes == Mode.ATTENTION).float().mean().item()
    shape = flops.step_shape(config, flops.matmul_params(model), bench.seq, bench.micro_batch, read)
    document_ids = packed_documents(bench.micro_batch, bench.seq).to(bench.device) if reset_at_eod else None
    row.update(params_m=sum(p.numel() for p in model.parameters()) / 1e6,
               attention_read=shape.attention_fraction,
               docs_per_sample=None if document_ids is None else float(document_ids[:, -1].float().mean() + 1))
    try:
        step, forward = training_step(model, modes, document_ids, bench)
        seconds = median_step_seconds(step, bench)
        activations = held_by_forward(forward, bench.device)
        if bench.profile_dir is not None:
            write_profile(step, bench, row)
    except Exception as error:  # e.g. a CUDA kernel that refuses this GPU
        status = "unsupported" if isinstance(error, NotImplementedError) else "failed"
        return dict(row, status=status, error=f"{type(error).__name__}: {error}")
    finally:
        del model
        gc.collect()
        if bench.device.type == "cuda":
            torch.cuda.empty_cache()
    step_flops = flops.train_step_flops(shape)
    peak_memory = torch.cuda.max_memory_allocated(bench.device) / 2**30 if bench.device.type == "cuda" else None
    tflops = step_flops / seconds / 1e12
    return dict(
        row, status="ok", step_ms=seconds * 1e3, tokens_per_s=bench.micro_batch * bench.seq / seconds,
        tflops=tflops, mfu=None if bench.peak_tflops is None else tflops / bench.peak_tflops,
        peak_memory_gib=peak_memory, activation_gib=activations / 2**30, flops=step_flops,
    )


def training_step(model, modes: Optional[torch.Tensor], document_ids: Optional[torch.Tensor],
                  bench: Bench) -> Tuple[Callable[[], None], Callable]:
    """(step, forward) on one fixed batch (with ``document_ids``: packed documents, each read alone):
    the step is forward with the LM loss, backward, AdamW step and zeroing the gradients; forward
    returns the loss alone."""
    ids = torch.randint(0, model.vocab_size, (bench.micro_batch, bench.seq + 1),
                        generator=torch.Generator().manual_seed(0)).to(bench.device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=bench.device.type == "cuda")
    if bench.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(bench.device)

    def forward() -> torch.Tensor:
        return model(ids[:, :-1], modes, labels=ids[:, 1:], document_ids=document_ids).float().mean()

    def step():
        forward().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step, forward


def write_profile(step: Callable[[], None], bench: Bench, row: dict) -> Path:
    """One step under torch.profiler: its ops by self time (device time on CUDA), the top 30, in
    ``<profile dir>/<model>[-p<p_attention>]-<recompute>.txt``."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if bench.device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities, record_shapes=True) as prof:
        step()
        synchronize(bench.device)
    sort = "self_cuda_time_total" if bench.device.type == "cuda" else "self_cpu_time_total"
    p = "" if row["p_attention"] is None else f"-p{row['p_attention']}"
    reset = "-reset" if row["reset_at_eod"] else ""
    bench.profile_dir.mkdir(parents=True, exist_ok=True)
    path = bench.profile_dir / f"{row['model']}{p}-{row['recompute']}{reset}.txt"
    path.write_text(prof.key_averages().table(sort_by=sort, row_limit=30) + "\n")
    return path


def held_by_forward(forward: Callable[[], torch.Tensor], device: torch.device) -> int:
    """Bytes that ``forward`` allocates and still holds when it returns (the saved activations)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device)
        loss = forward()
        held = torch.cuda.memory_allocated(device) - before
    else:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
            loss = forward()
        held = sum(event.self_cpu_memory_usage for event in prof.key_averages())
    del loss
    return held


def add_comparisons(rows: List[dict]) -> None:
    """vs_transformer: step time / the Transformer's at the same recompute setting;
    act_vs_none, time_vs_none: a recompute row against its model's row without recompute."""
    measured = {(r["model"], r["p_attention"], r["recompute"], r["reset_at_eod"]): r for r in rows if r["status"] == "ok"}
    for row in rows:
        if row["status"] != "ok":
            continue
        baseline = measured.get((BASELINE.name, None, row["recompute"], row["reset_at_eod"]))
        row["vs_transformer"] = row["step_ms"] / baseline["step_ms"] if baseline else None
        across = measured.get((row["model"], row["p_attention"], row["recompute"], False))
        row["time_vs_across"] = row["step_ms"] / across["step_ms"] - 1 if row["reset_at_eod"] and across else None
        no_recompute = measured.get((row["model"], row["p_attention"], "none", row["reset_at_eod"]))
        if row["recompute"] == "none" or no_recompute is None:
            continue
        row["time_vs_none"] = row["step_ms"] / no_recompute["step_ms"] - 1
        row["act_vs_none"] = row["activation_gib"] / no_recompute["activation_gib"] - 1


COLUMNS = (  # header, row key, format
    ("model", "model", "{}"),
    ("p_attn", "p_attention", "{:.2f}"),
    ("attn read", "attention_read", "{:.2f}"),
    ("recompute", "recompute", "{}"),
    ("docs", "docs_per_sample", "{:.1f}"),
    ("params M", "params_m", "{:.1f}"),
    ("step ms", "step_ms", "{:.1f}"),
    ("tokens/s", "tokens_per_s", "{:,.0f}"),
    ("TFLOP/s", "tflops", "{:.3g}"),
    ("MFU", "mfu", "{:.1%}"),
    ("peak GiB", "peak_memory_gib", "{:.2f}"),
    ("act GiB", "activation_gib", "{:.3g}"),
    ("vs transformer", "vs_transformer", "{:.2f}"),
    ("act vs none", "act_vs_none", "{:+.0%}"),
    ("time vs none", "time_vs_none", "{:+.0%}"),
    ("reset vs across", "time_vs_across", "{:+.0%}"),
    ("status", "status", "{}"),
)


def format_table(rows: List[dict]) -> str:
    """Aligned plain-text table; a missing value prints as "-" ("n/a" for MFU and memory),
    and the errors of rows that did not run follow the table."""
    cells = [[header for header, _, _ in COLUMNS]]
    for row in rows:
        cells.append([
            fmt.format(row[key]) if row.get(key) is not None
            else ("n/a" if key in ("mfu", "peak_memory_gib") and row["status"] == "ok" else "-")
            for _, key, fmt in COLUMNS
        ])
    widths = [max(len(line[i]) for line in cells) for i in range(len(COLUMNS))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(line, widths)))
             for line in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    lines += [f"{r['model']} p_attn={r['p_attention']} recompute={r['recompute']} reset_at_eod={r['reset_at_eod']}: "
              f"{r['status']}: {r['error']}" for r in rows if r["status"] != "ok"]
    return "\n".join(lines)


def default_peak_tflops(device: torch.device) -> Optional[float]:
    """989 on an H100/H200 (dense bf16), else unknown."""
    named = device.type == "cuda" and any(gpu in torch.cuda.get_device_name(device) for gpu in ("H100", "H200"))
    return H100_H200_BF16_TFLOPS if named else None


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--model-size", default="tiny", choices=MODEL_SIZES, help="recipe scale (default tiny)")
    parser.add_argument("--layers", type=int, help="num_layers instead of the recipe's")
    parser.add_argument("--hidden", type=int, help="hidden_size instead of the recipe's (MLP width scales with it)")
    parser.add_argument("--heads", type=int, help="num_attention_heads instead of the recipe's")
    parser.add_argument("--kernel-backend", choices=("auto", "torch", "cuda"), help="instead of the recipe's")
    parser.add_argument("--families", nargs="+", choices=[v.name for v in VARIANTS[1:]],
                        default=[v.name for v in VARIANTS[1:]], help="models besides the Transformer (default all)")
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--p-attention", type=float, nargs="+", default=[0.5, 0.1],
                        help="fractions of attention chunks for Oryx-TM / Oryx-TG (one row each)")
    parser.add_argument("--chunk", type=int, default=128, help="tokens per mode chunk")
    parser.add_argument("--recompute", nargs="+", choices=RECOMPUTE, default=["none"])
    parser.add_argument("--reset-at-eod", action="store_true",
                        help="also measure every row on packed documents read each alone (data.reset_at_eod)")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--peak-tflops", type=float, help="device peak for MFU (default 989 on H100/H200)")
    parser.add_argument("--json", help="also write the rows and the set-up to this file")
    parser.add_argument("--profile", type=Path, metavar="DIR",
                        help="also profile one step per row (torch.profiler): the top ops by self time in DIR/<row>.txt")
    return parser.parse_args(argv)


def planned_rows(args: argparse.Namespace) -> List[tuple]:
    """(variant, p_attention, recompute, reset_at_eod) of every row, the Transformer first."""
    variants = [BASELINE] + [v for v in VARIANTS[1:] if v.name in args.families]
    return [
        (variant, p, recompute, reset)
        for variant in variants
        for p in (args.p_attention if variant.reads_modes else [None])
        for recompute in args.recompute
        for reset in ((False, True) if args.reset_at_eod else (False,))
    ]


def main(argv=None) -> List[dict]:
    args = parse_args(argv)
    initialize_parallel()
    rows = []
    try:
        device = current_device()
        overrides = {field: value for field, value in (("num_layers", args.layers), ("hidden_size", args.hidden),
                                                       ("num_attention_heads", args.heads)) if value is not None}
        bench = Bench(
            size=args.model_size, shape_overrides=overrides, kernel_backend=args.kernel_backend, seq=args.seq,
            micro_batch=args.micro_batch, chunk=args.chunk, warmup=args.warmup, repeats=args.repeats,
            device=device, dtype=torch.bfloat16 if device.type == "cuda" else torch.float32,
            peak_tflops=args.peak_tflops or default_peak_tflops(device), profile_dir=args.profile,
        )
        setup = dict(
            date=datetime.datetime.now().isoformat(timespec="seconds"),
            device=(torch.cuda.get_device_name(device) if device.type == "cuda"
                    else f"CPU ({torch.get_num_threads()} threads)"),
            dtype=str(bench.dtype).removeprefix("torch."), torch=torch.__version__, model_size=args.model_size,
            shape_overrides=overrides, micro_batch=args.micro_batch, seq=args.seq, chunk=args.chunk,
            warmup=args.warmup, repeats=args.repeats, peak_tflops=bench.peak_tflops,
        )
        for plan in tqdm(planned_rows(args), desc="rows"):
            rows.append(measure(bench, *plan))
            add_comparisons(rows)
            if args.json:  # after every row: a run cut short keeps what it measured
                write_json(args.json, dict(setup=setup, rows=rows))
    finally:
        destroy_parallel()
    print(f"{setup['device']}, {setup['dtype']}, {args.model_size} recipes, micro-batch {args.micro_batch} x "
          f"{args.seq} tokens, median of {args.repeats} steps after {args.warmup} warm-up")
    print(format_table(rows))
    return rows


if __name__ == "__main__":
    main()
