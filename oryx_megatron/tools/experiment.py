"""oryx-experiment: train, evaluate and tabulate one experiment of recipes/experiment/.

    oryx-experiment e1_retrieval                      # the documented size (docs/results.md)
    oryx-experiment e2_lm --seeds 1 2 3 train.train_iters=600
    oryx-experiment a2_sequence_mixing --smoke        # seconds: the configuration `make test` runs
    oryx-experiment e1_retrieval_8pairs               # each family at its lr of best validation loss

An experiment lists model recipes, variants (extra oryx-train overrides), seeds, the
oryx-train overrides every run shares and one evaluation (an oryx-eval task). Every run
trains in this process into <out>/runs/<model>-s<seed>-<hash of its config>/ and is
reused while its config is unchanged: experiments that share runs (E3 evaluates E2's) train
them once, and a rerun after a crash only trains what is missing. Results go to
<out>/<experiment>/: results.json (every run's rows and the means over seeds), results.md
(the table) and a PNG (bars of the first metric, or the mode-switch curves).

Fair baselines: ``match_params`` names the model whose parameter count the others match
(their ``ffn_hidden_size``, tools/match_width.py); ``lrs`` is a learning-rate grid swept per
(variant, model): each lr trains ``sweep_seeds`` runs, ``choose_lr`` picks the lr of the
lowest validation loss (eval/validation.py: MQAR samples of a seed of their own, not the
test set's nor training's) and the experiment's seeds then train and are tested at that lr.
The selection sees validation losses only: the test evaluation runs after it. Tables give
mean ± std over seeds and every seed's value.
"""

import argparse
import dataclasses
import hashlib
import inspect
import json
import logging
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional

import numpy as np
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from oryx_megatron import RECIPES_DIR
from oryx_megatron.config import FAMILY_MIXERS
from oryx_megatron.eval import mode_switch
from oryx_megatron.eval.ppl import evaluate_ppl
from oryx_megatron.eval.retrieval import evaluate_retrieval
from oryx_megatron.eval.routing import evaluate_routing
from oryx_megatron.eval.validation import validation_loss
from oryx_megatron.inference.checkpoint import load_model
from oryx_megatron.checkpoint import latest_checkpoint
from oryx_megatron.run_config import TrainConfig, load_train_config, train_iters
from oryx_megatron.tools.match_width import matched_ffn

logger = logging.getLogger("oryx_megatron.experiment")

EXPERIMENTS_DIR = RECIPES_DIR / "experiment"
EVALS = {  # task -> the function its `eval` arguments go to (after model, run[, out])
    "ppl": evaluate_ppl,
    "mode_switch": mode_switch.evaluate_mode_switch,
    "mqar": evaluate_retrieval,
    "niah": evaluate_retrieval,
    "routing": evaluate_routing,  # a router per tested run (the experiment's `router` section)
}
ROW_LABELS = ("schedule", "switch")  # the column that names a row of an eval result
SMOKE_KEYS = ("train", "eval", "seeds", "lrs", "validation", "router")  # what a smoke section may replace or extend
MIN_LR_RATIO = 0.1  # a swept run's optimizer.min_lr is this times its lr


@dataclass
class Validation:
    """The validation split of a learning-rate sweep (eval/validation.py)."""

    seed: int = 1000  # must differ from every training seed and from the test's eval.seed
    num_samples: int = 256
    batch_size: int = 32


@dataclass
class Experiment:
    """Schema of recipes/experiment/<name>.yaml."""

    name: str
    claim: str  # the paper's claim under test, one line
    models: List[str]  # recipes/model/<name>
    seeds: List[int]
    eval: Dict[str, Any]  # task: one of EVALS; the rest: arguments of its function
    metrics: List[str]  # result columns tabulated (mean and std over seeds); the first is plotted
    groups: Dict[str, str] = field(default_factory=dict)  # oryx-train config-group choices, e.g. data: mqar
    train: Dict[str, Any] = field(default_factory=dict)  # oryx-train config (nested), shared by every run
    variants: Optional[Dict[str, Any]] = None  # name -> more oryx-train config; None: one variant, "base"
    match_params: Optional[str] = None  # a model of `models`: the others' ffn_hidden_size matched to its count
    lrs: List[float] = field(default_factory=list)  # optimizer.lr grid swept per (variant, model); []: no sweep
    sweep_seeds: Optional[List[int]] = None  # seeds of the sweep runs; None: the first of `seeds`
    validation: Validation = field(default_factory=Validation)
    # oryx-train config (nested) of a post-hoc router fitted to every tested run (router=posthoc,
    # init_from: that run's checkpoint); the evaluation then reads the model with its router
    router: Optional[Dict[str, Any]] = None
    smoke: Dict[str, Any] = field(default_factory=dict)  # SMOKE_KEYS: merged in (train, eval) or replaced by --smoke


def load_experiment(name: str, smoke: bool = False, seeds: Optional[List[int]] = None) -> Experiment:
    """The experiment's config (Hydra-composed: an experiment may extend another through its
    defaults list), checked against the schema; ``smoke`` merges its smoke section."""
    if not (EXPERIMENTS_DIR / f"{name}.yaml").exists():
        known = ", ".join(sorted(p.stem for p in EXPERIMENTS_DIR.glob("*.yaml")))
        raise ValueError(f"unknown experiment {name!r}; recipes/experiment/ has {known}")
    with initialize_config_dir(str(EXPERIMENTS_DIR), version_base=None):
        cfg = compose(name)
    try:
        exp: Experiment = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(Experiment), cfg))
    except OmegaConfBaseException as e:
        raise ValueError(f"recipes/experiment/{name}.yaml: {e.msg}") from None
    exp.variants = exp.variants or {"base": {}}
    if smoke:
        apply_smoke(exp, name)
    if seeds:
        exp.seeds = seeds
    exp.sweep_seeds = exp.sweep_seeds or exp.seeds[:1]
    task = exp.eval.get("task")
    if task not in EVALS:
        raise ValueError(f"recipes/experiment/{name}.yaml: eval.task={task!r}; expected one of {sorted(EVALS)}")
    allowed = set(inspect.signature(EVALS[task]).parameters) - {"model", "run", "out", "task"}  # set by evaluate
    unknown = set(eval_arguments(exp)) - allowed
    if unknown:
        raise ValueError(f"recipes/experiment/{name}.yaml: eval.{sorted(unknown)[0]} is not an argument of {task}")
    check_fairness(exp, name)
    return exp


def apply_smoke(exp: Experiment, name: str) -> None:
    """Merge the smoke section: train and eval extend, seeds, lrs and validation replace."""
    unknown = set(exp.smoke) - set(SMOKE_KEYS)
    if unknown:
        raise ValueError(f"recipes/experiment/{name}.yaml: smoke.{sorted(unknown)[0]} is not one of {SMOKE_KEYS}")
    exp.train = OmegaConf.to_container(OmegaConf.merge(exp.train, exp.smoke.get("train", {})))
    exp.eval = {**exp.eval, **exp.smoke.get("eval", {})}
    exp.seeds = list(exp.smoke.get("seeds", exp.seeds))
    exp.lrs = list(exp.smoke.get("lrs", exp.lrs))
    exp.validation = dataclasses.replace(exp.validation, **exp.smoke.get("validation", {}))
    if exp.router is not None:
        exp.router = OmegaConf.to_container(OmegaConf.merge(exp.router, exp.smoke.get("router", {})))


def check_fairness(exp: Experiment, name: str) -> None:
    """match_params is one of the models; a sweep has MQAR data and a validation seed that is
    neither a training seed nor the test's (eval.seed)."""
    where = f"recipes/experiment/{name}.yaml"
    if exp.match_params is not None and exp.match_params not in exp.models:
        raise ValueError(f"{where}: match_params={exp.match_params!r} is not one of models {exp.models}")
    if not exp.lrs:
        return
    if exp.groups.get("data") != "mqar":
        raise ValueError(f"{where}: lrs needs groups.data=mqar (the validation split is generated MQAR), "
                         f"got {exp.groups.get('data')!r}")
    test_seed = exp.eval.get("seed", 0)
    if exp.validation.seed in {*exp.seeds, *exp.sweep_seeds, test_seed}:
        raise ValueError(f"{where}: validation.seed={exp.validation.seed} must differ from the training seeds "
                         f"{sorted({*exp.seeds, *exp.sweep_seeds})} and the test's eval.seed={test_seed}")


def eval_arguments(exp: Experiment) -> Dict[str, Any]:
    return {k: v for k, v in exp.eval.items() if k != "task"}


def overrides(tree: Dict[str, Any], prefix: str = "") -> List[str]:
    """A nested oryx-train config as Hydra overrides: {data: {seq_length: 64}} -> data.seq_length=64."""
    out = []
    for key, value in tree.items():
        if isinstance(value, dict):
            out += overrides(value, f"{prefix}{key}.")
        else:
            out.append(f"{prefix}{key}={json.dumps(value)}")  # JSON is Hydra's syntax for scalars and lists
    return out


def run_overrides(exp: Experiment) -> List[str]:
    """The oryx-train overrides every run of ``exp`` shares: group choices, then fields."""
    return [f"{group}={choice}" for group, choice in exp.groups.items()] + overrides(exp.train)


def compose_run(model: str, seed: int, config: List[str]) -> TrainConfig:
    """The oryx-train config of one run (checkpoint.dir is set by the caller)."""
    with initialize_config_dir(str(RECIPES_DIR), version_base=None):
        cfg = compose("train", overrides=[f"model={model}", f"train.seed={seed}", "checkpoint.dir=null", *config])
    return load_train_config(cfg)


# Fields that do not shape the trained weights: runs differing only there are the same run.
NOT_IN_RUN_KEY = {"train": ("log_interval", "eval_interval", "eval_iters", "eval_schedules", "exit_interval")}
# fields added after runs were keyed: left out at their default, so that the earlier runs keep their keys
ADDED_WITH_DEFAULT = {"data": {"reset_at_eod": False},
                      "model": {"router_hidden": None, "router_chunk_size": 128, "mixer_conv_activation": "silu",
                                "attention_rotary": True, "rotary_base": 10000.0, "A_init_range": [1.0, 16.0],
                                "dt_min": 0.001, "dt_max": 0.1, "dt_init_floor": 1e-4}}


def run_key(run: TrainConfig) -> str:
    """A hash of the model, data, optimizer, parallel and training settings that shape the
    trained weights (not where or how often they are logged, evaluated or saved)."""
    identity = OmegaConf.to_container(OmegaConf.structured(run))
    for section in ("checkpoint", "logging"):
        identity.pop(section)
    for section, keys in NOT_IN_RUN_KEY.items():
        for key in keys:
            identity[section].pop(key)
    if identity["router"]["mode"] == "none":  # added later too: the whole section when no router trains
        identity.pop("router")
    if identity["model"]["mixers"] == FAMILY_MIXERS[identity["model"]["family"]]:  # a family's own: not a field then
        identity["model"].pop("mixers")
    for section, defaults in ADDED_WITH_DEFAULT.items():
        for key, default in defaults.items():
            if identity[section][key] == default:
                identity[section].pop(key)
    return hashlib.sha1(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:8]


def train_or_reuse(run: TrainConfig, run_dir: Path) -> Path:
    """Train ``run`` into ``run_dir`` unless a checkpoint at its last iteration is there;
    an unfinished run resumes from its latest checkpoint. Returns the checkpoint."""
    from oryx_megatron.train import pretrain  # imports megatron's training stack

    ckpt_dir = run_dir / "checkpoints"
    latest = latest_checkpoint(str(ckpt_dir))
    if latest is not None and latest.name == f"iter_{train_iters(run):07d}":
        logger.info("reusing %s", latest)
        return latest
    run = dataclasses.replace(run, checkpoint=dataclasses.replace(run.checkpoint, dir=str(ckpt_dir), save_at_end=True))
    exit_code = pretrain(run, str(run_dir))
    if exit_code:
        raise RuntimeError(f"training {run_dir} stopped early (exit code {exit_code}); rerun the experiment to resume")
    return latest_checkpoint(str(ckpt_dir))


def train_and_load(model: str, seed: int, config: List[str], out: Path):
    """(the trained model, its run config, its run name): trained unless an equal run exists."""
    run = compose_run(model, seed, config)
    name = f"{model}-s{seed}-{run_key(run)}"  # no variant: equal configs share one run
    checkpoint = train_or_reuse(run, out / "runs" / name)
    net, run = load_model(str(checkpoint))
    return net, run, name


def width_overrides(exp: Experiment, config: List[str]) -> Dict[str, List[str]]:
    """Per model, the override that matches its parameter count to ``match_params``' ([] for
    that model, and for every model when unset)."""
    if exp.match_params is None:
        return {model: [] for model in exp.models}
    shape = {model: compose_run(model, exp.seeds[0], config).model for model in exp.models}
    return {model: [] if model == exp.match_params else
            [f"model.ffn_hidden_size={matched_ffn(shape[exp.match_params], shape[model])}"] for model in exp.models}


def lr_overrides(lr: float) -> List[str]:
    return [f"optimizer.lr={lr}", f"optimizer.min_lr={lr * MIN_LR_RATIO:.6g}"]


def choose_lr(validation_losses: Dict[float, List[float]]) -> float:
    """The learning rate of the lowest mean validation loss over seeds (a non-finite loss
    loses); ties go to the smaller learning rate. Validation losses are all it sees."""
    if not validation_losses:
        raise ValueError("choose_lr: no learning rates to choose from")

    def mean(lr: float) -> float:
        value = float(np.mean(validation_losses[lr]))
        return value if np.isfinite(value) else float("inf")

    return min(sorted(validation_losses), key=mean)


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
    rows, sweeps, started = [], [], time.perf_counter()
    for variant in exp.variants:
        base = run_overrides(exp) + overrides(exp.variants[variant] or {}) + extra
        widths = width_overrides(exp, base)
        for model in exp.models:
            config = base + widths[model]
            if exp.lrs:
                losses = sweep_lr(exp, model, config, out)
                lr = choose_lr(losses)
                sweeps.append(dict(variant=variant, model=model, lr=lr, seeds=exp.sweep_seeds,
                                   validation_loss={str(k): v for k, v in losses.items()}))
                config = config + lr_overrides(lr)
            for seed in exp.seeds:
                net, run, name = train_and_load(model, seed, config, out)
                if exp.router is not None:  # its router, fitted to the frozen run
                    fitted = ["router=posthoc", f"router.init_from={out / 'runs' / name / 'checkpoints'}"]
                    net, run, name = train_and_load(model, seed, config + fitted + overrides(exp.router), out)
                logger.info("testing %s", name)
                eval_dir = exp_dir / "evals" / name
                eval_dir.mkdir(parents=True, exist_ok=True)
                result = evaluate(exp, net, run, eval_dir)
                params = sum(p.numel() for p in net.parameters())
                rows += [dict(variant=variant, model=model, seed=seed, run=name, params=params,
                              lr=run.optimizer.lr, **row) for row in result["rows"]]
    summary = summarize(rows, exp.metrics)
    results = dict(experiment=exp.name, claim=exp.claim, seeds=exp.seeds, train=run_overrides(exp) + extra,
                   variants={k: overrides(v or {}) for k, v in exp.variants.items()}, eval=exp.eval,
                   match_params=exp.match_params, validation=dataclasses.asdict(exp.validation), sweeps=sweeps,
                   wall_time_s=round(time.perf_counter() - started, 1), summary=summary, rows=rows)
    (exp_dir / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    (exp_dir / "results.md").write_text(results_markdown(exp, summary, sweeps))
    plot = {"mode_switch": plot_curves, "routing": plot_fractions}.get(exp.eval["task"])
    plot = plot(exp, rows, exp_dir) if plot else plot_bars(exp, summary, exp_dir)
    logger.info("wrote %s, results.md and %s (%.0f s)", exp_dir / "results.json", plot.name, results["wall_time_s"])
    return results


def results_markdown(exp: Experiment, summary: List[dict], sweeps: List[dict]) -> str:
    text = (f"# {exp.name}\n\n{exp.claim}\n\n## {exp.metrics[0]}\n\n{pivot_table(summary, exp.metrics[0])}\n\n"
            f"## All metrics\n\n{markdown_table(summary, exp.metrics)}\n")
    if sweeps:
        text += (f"\n## Learning rate: validation loss (seed {exp.validation.seed}, {exp.validation.num_samples} "
                 f"samples), sweep seeds {exp.sweep_seeds}\n\n{sweep_table(sweeps)}\n")
    return text


def sweep_table(sweeps: List[dict]) -> str:
    """A row per (variant, model): validation loss per learning rate (mean, and each sweep seed's
    in parentheses when more than one), and the chosen learning rate."""
    lrs = list(dict.fromkeys(lr for s in sweeps for lr in s["validation_loss"]))
    lines = ["| variant | model | " + " | ".join(f"lr {lr}" for lr in lrs) + " | chosen lr |",
             "|" + "---|" * (len(lrs) + 3)]
    for s in sweeps:
        cells = [values_cell(s["validation_loss"][lr]) if lr in s["validation_loss"] else "" for lr in lrs]
        lines.append("| " + " | ".join([s["variant"], s["model"], *cells, f"{s['lr']:g}"]) + " |")
    return "\n".join(lines)


def values_cell(values: List[float]) -> str:
    mean = f"{float(np.mean(values)):.4f}"
    return mean if len(values) == 1 else f"{mean} ({', '.join(f'{v:.4f}' for v in values)})"


def evaluate(exp: Experiment, model, run: TrainConfig, out: Path) -> dict:
    """The experiment's eval task on one trained model; mode_switch writes its CSV to ``out``."""
    task, kwargs = exp.eval["task"], eval_arguments(exp)
    if task == "mode_switch":
        kwargs["out"] = out
    if task in ("mqar", "niah"):
        kwargs["task"] = task
    return EVALS[task](model, run, **kwargs)


def row_label(row: dict) -> str:
    return next(row[key] for key in ROW_LABELS if key in row)


def summarize(rows: List[dict], metrics: List[str]) -> List[dict]:
    """One row per (variant, model, row label): mean and std over seeds of each metric
    (None where a seed has none, e.g. a switch that never converged)."""
    groups: Dict[tuple, List[dict]] = {}
    for row in rows:
        groups.setdefault((row["variant"], row["model"], row_label(row)), []).append(row)
    summary = []
    for (variant, model, label), members in groups.items():
        entry = dict(variant=variant, model=model, label=label, params=members[0]["params"], lr=members[0].get("lr"),
                     seeds=len(members))
        for metric in metrics:
            values = [m.get(metric) for m in members]
            missing = None in values
            entry[metric] = None if missing else float(np.mean(values))
            entry[f"{metric}_std"] = None if missing else float(np.std(values))
            entry[f"{metric}_per_seed"] = values
        summary.append(entry)
    return summary


def cell(row: dict, metric: str) -> str:
    """'mean ± std (every seed's value)' of a summary row's metric ('n/a' for the mean where a
    seed has none, '-' for that seed)."""
    mean, std, values = row[metric], row[f"{metric}_std"], row[f"{metric}_per_seed"]
    per_seed = "(" + ", ".join("-" if v is None else f"{v:.4g}" for v in values) + ")"
    if mean is None:
        return f"n/a {per_seed}"
    return f"{mean:.4f}" + (f" ± {std:.4f} {per_seed}" if row["seeds"] > 1 else "")


def markdown_table(summary: List[dict], metrics: List[str]) -> str:
    """The summary as a Markdown table: a row per (variant, model, row label), mean ± std over
    seeds and every seed's value."""
    header = ["variant", "model", "row", "params", "lr", "seeds", *metrics]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in summary:
        lr = "-" if row["lr"] is None else f"{row['lr']:g}"
        cells = [row["variant"], row["model"], row["label"], f"{row['params']:,}", lr, str(row["seeds"])]
        lines.append("| " + " | ".join(cells + [cell(row, m) for m in metrics]) + " |")
    return "\n".join(lines)


def grid(summary: List[dict]):
    """(the (variant, model) groups, the row labels, summary rows by (variant, model, label)), in order."""
    groups = list(dict.fromkeys((r["variant"], r["model"]) for r in summary))
    labels = list(dict.fromkeys(r["label"] for r in summary))
    return groups, labels, {(r["variant"], r["model"], r["label"]): r for r in summary}


def pivot_table(summary: List[dict], metric: str) -> str:
    """``metric`` (mean ± std) as a Markdown table: a row per (variant, model), a column per row label."""
    groups, labels, by_key = grid(summary)
    header = ["variant", "model", *labels]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for variant, model in groups:
        cells = [cell(by_key[variant, model, label], metric) if (variant, model, label) in by_key else ""
                 for label in labels]
        lines.append("| " + " | ".join([variant, model, *cells]) + " |")
    return "\n".join(lines)


def plot_bars(exp: Experiment, summary: List[dict], exp_dir: Path) -> Path:
    """Grouped bars of the first metric: one group per (variant, model), one bar per row label."""
    from matplotlib.figure import Figure

    metric = exp.metrics[0]
    groups, labels, by_key = grid(summary)
    fig = Figure(figsize=(max(6.0, 1.4 * len(groups)), 4.5))
    ax = fig.subplots()
    width = 0.8 / len(labels)
    spans = []  # (mean - std, mean + std) of every bar
    for j, label in enumerate(labels):
        rows = [by_key.get((*g, label)) for g in groups]
        means = np.array([np.nan if r is None or r[metric] is None else r[metric] for r in rows])
        stds = np.array([0.0 if r is None or r[f"{metric}_std"] is None else r[f"{metric}_std"] for r in rows])
        ax.bar(np.arange(len(groups)) + (j - (len(labels) - 1) / 2) * width, means, width, yerr=stds, capsize=2,
               label=label)
        spans += [means - stds, means + stds]
    low, high = np.nanmin(spans[0::2]), np.nanmax(spans[1::2])
    if low > 0.5 * high:  # e.g. losses: zoom in on the differences
        ax.set_ylim(low - 0.2 * (high - low), high + 0.2 * (high - low))
    names = [model if len(exp.variants) == 1 else f"{model}\n{variant}" for variant, model in groups]
    ax.set_xticks(np.arange(len(groups)), names, fontsize=8)
    ax.set(ylabel=f"{metric} (mean ± std over {len(exp.seeds)} seeds)", title=f"{exp.name}: {metric}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = exp_dir / f"{metric}.png"
    fig.savefig(path, dpi=120)
    return path


# one colour per kind of schedule in every routing plot (tab10's first six)
KIND_COLORS = dict(zip(("all", "oracle", "router", "random", "first", "last"), (f"C{i}" for i in range(6))))


def plot_fractions(exp: Experiment, rows: List[dict], exp_dir: Path) -> Path:
    """The first metric against the attention fraction (means over seeds): a line per kind of
    schedule (router, random, first, last chunks), points for all_linear, all_attention and the
    oracle; a panel per (variant, model)."""
    from matplotlib.figure import Figure

    metric = exp.metrics[0]
    panels = list(dict.fromkeys((r["variant"], r["model"]) for r in rows))
    fig = Figure(figsize=(5.5 * len(panels), 4.2))
    axes = np.atleast_1d(fig.subplots(1, len(panels), sharey=True))
    for ax, (variant, model) in zip(axes, panels):
        mine = [r for r in rows if (r["variant"], r["model"]) == (variant, model)]
        for kind in dict.fromkeys(r["kind"] for r in mine):
            labels = list(dict.fromkeys(r["schedule"] for r in mine if r["kind"] == kind))
            points = sorted((np.mean([r["attention_fraction"] for r in mine if r["schedule"] == label]),
                             np.mean([r[metric] for r in mine if r["schedule"] == label])) for label in labels)
            x, y = np.array(points).T
            style = "o-" if kind in ("router", "random", "first", "last") else "s"
            ax.plot(x, y, style, color=KIND_COLORS[kind], markersize=5,
                    label=kind if kind != "all" else "all_linear / all_attention")
        ax.set(xlabel="attention fraction (tokens)", title=model if len(exp.variants) == 1 else f"{model} ({variant})")
    axes[0].set_ylabel(f"{metric} (mean over {len(exp.seeds)} seeds)")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    path = exp_dir / "routing.png"
    fig.savefig(path, dpi=120)
    return path


def plot_curves(exp: Experiment, rows: List[dict], exp_dir: Path) -> Path:
    """Per-position loss of the four mode-switch schedules, mean over seeds; a panel per
    (variant, model)."""
    from matplotlib.figure import Figure

    runs: Dict[tuple, List[str]] = {}
    for row in rows:
        names = runs.setdefault((row["variant"], row["model"]), [])
        if row["run"] not in names:
            names.append(row["run"])
    fig = Figure(figsize=(5.5 * len(runs), 4.2))
    axes = np.atleast_1d(fig.subplots(1, len(runs), sharey=True))
    switch_at, width = exp.eval.get("t"), exp.eval.get("smooth_width", 16)
    for ax, ((variant, model), names) in zip(axes, runs.items()):
        tables = [np.genfromtxt(exp_dir / "evals" / n / "mode_switch.csv", delimiter=",", names=True) for n in names]
        curves = {c: mode_switch.smooth(np.mean([t[f"loss_{c}"] for t in tables], axis=0), 0, width)
                  for c in mode_switch.CURVES}
        mode_switch.draw_curves(ax, curves, switch_at if switch_at is not None else len(tables[0]) // 2)
        ax.set(title=model if len(exp.variants) == 1 else f"{model} ({variant})")
    axes[0].set_ylabel(f"held-out loss, {width}-token trailing mean, {len(exp.seeds)} seeds")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    path = exp_dir / "mode_switch.png"
    fig.savefig(path, dpi=120)
    return path


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="oryx-experiment", description=__doc__.split("\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("experiment", help="a name of recipes/experiment/ (e.g. e1_retrieval)")
    parser.add_argument("overrides", nargs="*", help="oryx-train overrides for every run (key=value)")
    parser.add_argument("--out", default="runs/experiments", help="output root (default runs/experiments)")
    parser.add_argument("--seeds", type=int, nargs="+", help="replace the experiment's seeds")
    parser.add_argument("--smoke", action="store_true", help="the seconds-long configuration (tests)")
    args = parser.parse_intermixed_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    bad = [o for o in args.overrides if "=" not in o]
    if bad:
        parser.error(f"override {bad[0]!r} is not key=value")
    try:
        exp = load_experiment(args.experiment, args.smoke, args.seeds)
    except ValueError as e:
        parser.error(str(e))
    results = run_experiment(exp, Path(args.out), args.overrides)
    print(markdown_table(results["summary"], exp.metrics))
    return 0


if __name__ == "__main__":
    sys.exit(main())
