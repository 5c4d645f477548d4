"""Sections c and d of the GPU check, per family in the order given: ``pretrain`` on synthetic MQAR
(the uninterrupted run), its performance row at once (tokens/s, MFU, peak memory: section d), then the
same run stopped half-way, resumed, and compared with the uninterrupted one (section c). A run cut at
any point keeps the rows of the families before it, and the performance row of the one it was in."""

import gc
import math
import shutil
import statistics
from pathlib import Path
from typing import List

import torch

from oryx_megatron.checks.gpu_check.report import Report, failed
from oryx_megatron.checks.gpu_check.setup import PERF_SKIP, RESUME_ATOL, RESUME_FLOOR_FACTOR, Setup, Sizes


def train_overrides(family: str, sizes: Sizes) -> List[str]:
    """oryx-train overrides of the check's runs of `family` (checkpointing aside)."""
    overrides = [sizes.train_model.format(family=family), "data=mqar", f"data.seq_length={sizes.seq_length}",
                 f"data.mqar_vocab_size={sizes.mqar_vocab_size}", f"data.mqar_num_pairs={sizes.mqar_num_pairs}",
                 f"train.train_iters={sizes.train_iters}",
                 "train.train_tokens=null", f"train.micro_batch_size={sizes.micro_batch_size}",
                 f"train.global_batch_size={sizes.global_batch_size}", "train.log_interval=1",
                 "train.eval_interval=null", f"train.bf16={str(sizes.bf16).lower()}",
                 "optimizer.lr_warmup_iters=2", "logging.wandb_mode=disabled"]
    return overrides + ([f"optimizer.lr={sizes.lr}"] if sizes.lr is not None else [])


def train(overrides: List[str], output_dir: Path) -> List[float]:
    """pretrain() of the composed config; the train/loss of every step it logged."""
    from hydra import compose, initialize_config_dir

    from oryx_megatron import RECIPES_DIR
    from oryx_megatron.training.loop import pretrain
    from oryx_megatron.run_config import load_train_config

    with initialize_config_dir(str(RECIPES_DIR), version_base=None):
        run = load_train_config(compose("train", overrides=overrides))
    if torch.cuda.is_available():  # perf/memory_gb is the peak since the last reset: this run's
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    code = pretrain(run, str(output_dir))
    if code != 0:
        raise RuntimeError(f"pretrain returned {code}")
    return [row["train/loss"] for row in metrics(output_dir) if "train/loss" in row]


def metrics(output_dir: Path) -> List[dict]:
    from oryx_megatron.training.metrics import read_rows

    return read_rows(output_dir / "metrics.jsonl")


def check_training(setup: Setup, report: Report) -> None:
    """Per family: the uninterrupted run, its performance row, then the resume check's row."""
    for family in setup.families:
        root = setup.out / "training" / family
        shutil.rmtree(root, ignore_errors=True)  # metrics.jsonl appends, and a checkpoint would be resumed
        row = {"family": family, "iterations": setup.sizes.train_iters}
        try:
            overrides = train_overrides(family, setup.sizes)
            straight = train([*overrides, "checkpoint.dir=null", "checkpoint.save_at_end=false"], root / "straight")
        except Exception as e:
            report.add(failed(row, e))
            report.add(performance_row(family, setup), section="performance")  # fails: no metrics
            continue
        report.add(performance_row(family, setup), section="performance")
        report.add(resume_row(row, overrides, straight, root, setup))


def resume_row(row: dict, overrides: List[str], straight: List[float], root: Path, setup: Setup) -> dict:
    """The run stopped half-way (checkpoint saved), resumed, against the uninterrupted ``straight`` curve."""
    s = setup.sizes
    try:
        split = [*overrides, f"checkpoint.dir={root / 'ckpt'}", f"train.exit_interval={s.train_iters // 2}",
                 "checkpoint.save_at_end=true"]
        first = train(split, root / "first")  # stops at exit_interval, saving a checkpoint
        second = train(split, root / "second")  # resumes from it
        shutil.rmtree(root / "ckpt")  # 2 GB at 130M
        if len(first) + len(second) != len(straight) or len(straight) != s.train_iters:
            raise RuntimeError(f"logged {len(first)} + {len(second)} steps resumed, {len(straight)} straight, "
                               f"expected {s.train_iters}")
    except Exception as e:
        return failed(row, e)
    half = len(first)
    row = {
        **row, "loss_first": straight[0], "loss_last": straight[-1],
        "finite": all(math.isfinite(x) for x in straight + first + second),
        "falling": straight[-1] < straight[0],
        "resume_max_abs_diff": max(abs(a - b) for a, b in zip(second, straight[half:])),
        "diff_before_resume": max(abs(a - b) for a, b in zip(first, straight[:half])),
    }
    # the run-to-run floor: the first half ran the same steps twice (non-deterministic GPU atomics)
    row["tolerance"] = max(RESUME_ATOL[setup.device.type], RESUME_FLOOR_FACTOR * row["diff_before_resume"])
    ok = row["finite"] and row["falling"] and row["resume_max_abs_diff"] <= row["tolerance"]
    return {**row, "status": "pass" if ok else "fail"}


def performance_row(family: str, setup: Setup) -> dict:
    """Tokens/s and MFU (medians after the first PERF_SKIP steps) and peak memory of the uninterrupted run."""
    note = "dry run: CPU numbers (memory: peak RSS), not a GPU measurement" if setup.dry_run else ""
    row = {"family": family, "note": note}
    try:
        steps = [r for r in metrics(setup.out / "training" / family / "straight") if "perf/tokens_per_s" in r]
        timed = steps[PERF_SKIP:] or steps
        row.update(tokens_per_s=statistics.median(r["perf/tokens_per_s"] for r in timed),
                   mfu=statistics.median(r["perf/mfu"] for r in timed),
                   memory_gb=max(r["perf/memory_gb"] for r in steps))
    except Exception as e:
        return failed(row, e, prefix="no training metrics (section c): ")
    ok = all(math.isfinite(row[k]) and row[k] > 0 for k in ("tokens_per_s", "mfu", "memory_gb"))
    return {**row, "status": "pass" if ok else "fail"}
