"""``run_experiment``: per (variant, model), match the width, sweep the learning rate, train (or reuse) and
test every seed; then write results.json, results.md and the plot."""

import dataclasses
import json
import logging
import time
from collections import Counter
from pathlib import Path
from typing import Dict, List

from oryx_megatron.checkpoint import latest_name
from oryx_megatron.eval.validation import validation_loss
from oryx_megatron.experiments.config import EVALS, Experiment, eval_arguments
from oryx_megatron.experiments.plots import plot_bars, plot_curves, plot_fractions
from oryx_megatron.experiments.runs import (
    choose_lr, lr_overrides, overrides, run_overrides, train_and_load, trained_by, width_overrides,
)
from oryx_megatron.experiments.tables import markdown_table, pivot_table, summarize, sweep_table
from oryx_megatron.run_config import TrainConfig

logger = logging.getLogger("oryx_megatron.experiment")

def sweep_lr(exp: Experiment, model: str, config: List[str], out: Path) -> Dict[float, List[float]]:
    """Validation loss of ``model`` per learning rate of the grid, one per sweep seed."""
    v = exp.validation
    losses = {}
    for lr in exp.lrs:
        losses[lr] = []
        for seed in exp.sweep_seeds:
            net, run, name = train_and_load(model, seed, config + lr_overrides(lr), out)
            losses[lr].append(validation_loss(net, run, v.seed, v.num_samples, v.batch_size))
            logger.info("sweep %s lr=%g: validation loss %.4f", name, lr, losses[lr][-1])
    return losses


def run_experiment(exp: Experiment, out: Path, extra: List[str]) -> dict:
    """Per (variant, model): match its width, sweep its learning rate on the validation split
    (if ``exp.lrs``), then train (or reuse) and test every seed; write the results."""
    exp_dir = out / exp.name
    exp_dir.mkdir(parents=True, exist_ok=True)
    rows, sweeps, sources, started = [], [], {}, time.perf_counter()
    for variant in exp.variants:
        base = run_overrides(exp) + overrides(exp.variants[variant] or {}) + extra
        widths = width_overrides(exp, base)
        for model in exp.models:
            config = base + widths[model]
            if model in exp.model_lrs:
                config = config + lr_overrides(exp.model_lrs[model])
            if exp.lrs:
                losses = sweep_lr(exp, model, config, out)
                lr = choose_lr(losses)
                sweeps.append(dict(variant=variant, model=model, lr=lr, seeds=exp.sweep_seeds,
                                   validation_loss={str(k): v for k, v in losses.items()}))
                config = config + lr_overrides(lr)
            for seed in exp.seeds:
                net, run, name = train_and_load(model, seed, config, out)
                lr, trained = run.optimizer.lr, [f"router.init_from={out / 'runs' / name / 'checkpoints'}"]
                tested = [(net, run, name, "")]
                if exp.router is not None:  # its router, fitted to the frozen run
                    tested = [train_and_load(model, seed, config + ["router=posthoc"] + trained
                                             + overrides(exp.router), out) + ("",)]
                if exp.joint is not None:  # the run trained on with a joint router
                    tested.append(train_and_load(model, seed, config + ["router=joint"] + trained
                                                 + overrides(exp.joint), out) + ("joint:",))
                for net, run, name, prefix in tested:
                    logger.info("testing %s", name)
                    # the checkpoint train_and_load verified and loaded: read, not verified again
                    sources[name] = trained_by(latest_name(str(out / "runs" / name / "checkpoints")))
                    eval_dir = exp_dir / "evals" / name
                    eval_dir.mkdir(parents=True, exist_ok=True)
                    result = evaluate(exp, net, run, eval_dir)
                    params = sum(p.numel() for p in net.parameters())
                    rows += [dict(variant=variant, model=model, seed=seed, run=name, params=params, lr=lr,
                                  **prefixed(row, prefix)) for row in result["rows"]]  # lr: the tested run's
    summary = summarize(rows, exp.metrics)
    results = dict(experiment=exp.name, claim=exp.claim, seeds=exp.seeds, train=run_overrides(exp) + extra,
                   variants={k: overrides(v or {}) for k, v in exp.variants.items()}, eval=exp.eval,
                   match_params=exp.match_params, model_lrs=exp.model_lrs,
                   validation=dataclasses.asdict(exp.validation), sweeps=sweeps,
                   wall_time_s=round(time.perf_counter() - started, 1), trained_by=sources, summary=summary,
                   rows=rows)
    (exp_dir / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    (exp_dir / "results.md").write_text(results_markdown(exp, summary, sweeps, sources))
    plot = {"mode_switch": plot_curves, "routing": plot_fractions}.get(exp.eval["task"])
    plot = plot(exp, rows, exp_dir) if plot else plot_bars(exp, summary, exp_dir)
    logger.info("wrote %s, results.md and %s (%.0f s)", exp_dir / "results.json", plot.name, results["wall_time_s"])
    return results


def results_markdown(exp: Experiment, summary: List[dict], sweeps: List[dict], sources: Dict[str, str]) -> str:
    """The tables, then which code trained the tested runs (``sources``: run name -> ``trained_by``)."""
    text = (f"# {exp.name}\n\n{exp.claim}\n\n## {exp.metrics[0]}\n\n{pivot_table(summary, exp.metrics[0])}\n\n"
            f"## All metrics\n\n{markdown_table(summary, exp.metrics)}\n")
    if sweeps:
        text += (f"\n## Learning rate: validation loss (seed {exp.validation.seed}, {exp.validation.num_samples} "
                 f"samples), sweep seeds {exp.sweep_seeds}\n\n{sweep_table(sweeps)}\n")
    counts = sorted(Counter(sources.values()).items())
    return text + "\nTrained by the code at: " + ", ".join(f"{by} ({n} run{'s' * (n > 1)})" for by, n in counts) + "\n"


def prefixed(row: dict, prefix: str) -> dict:
    """A joint router's row: its label prefixed, its router rows of kind "joint", its others "joint:<kind>"."""
    if not prefix:
        return row
    kind = "joint" if row["kind"] == "router" else prefix + row["kind"]
    return dict(row, schedule=prefix + row["schedule"], kind=kind)


def evaluate(exp: Experiment, model, run: TrainConfig, out: Path) -> dict:
    """The experiment's eval task on one trained model; mode_switch writes its CSV to ``out``. A joint router
    (no calibration) reads its budgets at p >= 0.5 under the budget's quota (inference/routing.py)."""
    task, kwargs = exp.eval["task"], eval_arguments(exp)
    if task == "mode_switch":
        kwargs["out"] = out
    if task in ("mqar", "niah"):
        kwargs["task"] = task
    return EVALS[task](model, run, **kwargs)
