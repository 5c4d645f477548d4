"""The plot of an experiment: bars of the first metric, the routing curves, or the mode-switch curves."""

from pathlib import Path
from typing import Dict, List

import numpy as np

from oryx_megatron.eval import mode_switch
from oryx_megatron.experiments.config import Experiment
from oryx_megatron.experiments.tables import grid

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
    if high > low > 0.5 * high:  # e.g. losses: zoom in on the differences
        ax.set_ylim(low - 0.2 * (high - low), high + 0.2 * (high - low))
    elif low >= 0:  # accuracies, fractions: from 0 (to 1 when every bar is 0)
        ax.set_ylim(0, 1.1 * high if high > 0 else 1)
    names = [model if len(exp.variants) == 1 else f"{model}\n{variant}" for variant, model in groups]
    ax.set_xticks(np.arange(len(groups)), names, fontsize=8)
    ax.set(ylabel=f"{metric} (mean ± std over {len(exp.seeds)} seeds)", title=f"{exp.name}: {metric}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = exp_dir / f"{metric}.png"
    fig.savefig(path, dpi=120)
    return path


# one colour per kind of schedule in every routing plot (tab10's first seven)
KIND_COLORS = dict(zip(("all", "oracle", "router", "random", "first", "last", "entropy"), (f"C{i}" for i in range(7))))


def plot_fractions(exp: Experiment, rows: List[dict], exp_dir: Path) -> Path:
    """The first metric against the attention fraction (means over seeds), a panel per (variant, model) and per
    model tested: the base run (its post-hoc router) and, where the experiment has one, the run trained on with
    a joint router (its ``joint:`` rows). In each a line per kind of schedule (router, random, first, last
    chunks, entropy), points for all_linear and the oracle, all_attention a dotted line (its fraction, 1, lies
    far right of the others: the x axis stops past the largest other fraction)."""
    from matplotlib.figure import Figure

    metric = exp.metrics[0]
    models = list(dict.fromkeys((r["variant"], r["model"]) for r in rows))
    tested = ["base"] + (["joint"] if any(r["schedule"].startswith("joint:") for r in rows) else [])
    fig = Figure(figsize=(5.0 * len(models), 3.8 * len(tested)))
    bounded = metric == "accuracy"  # from 0 to 1, one scale for all panels; a loss: each panel its own range
    axes = fig.subplots(len(tested), len(models), sharey=bounded, squeeze=False)
    for row_axes, group in zip(axes, tested):
        for ax, (variant, model) in zip(row_axes, models):
            mine = [dict(r, kind=_base_kind(r)) for r in rows if (r["variant"], r["model"]) == (variant, model)
                    and r["schedule"].startswith("joint:") == (group == "joint")]
            _draw_kinds(ax, mine, metric)
            name = model if len(exp.variants) == 1 else f"{model} ({variant})"
            ax.set(xlabel="attention fraction (tokens)",
                   title=name + (": joint router (model trained on with it)" if group == "joint" else ""))
    values = [r[metric] for r in rows if r[metric] is not None]
    if values and bounded:  # from 0 (to 1 when every point is 0)
        axes[0, 0].set_ylim(0, 1.1 * max(values) if max(values) > 0 else 1)
    for ax in axes[:, 0]:
        ax.set_ylabel(f"{metric} (mean over {len(exp.seeds)} seeds)")
    axes[0, 0].legend(fontsize=7)
    fig.tight_layout()
    path = exp_dir / "routing.png"
    fig.savefig(path, dpi=120)
    return path


def _base_kind(row: dict) -> str:
    """The kind of schedule a row is, joint or not: the joint router's rows are ``router`` in their panel."""
    return "router" if row["kind"] == "joint" else row["kind"].removeprefix("joint:")


def _draw_kinds(ax, rows: List[dict], metric: str) -> None:
    right = 0.0
    for kind in [k for k in dict.fromkeys(r["kind"] for r in rows) if k in KIND_COLORS]:
        labels = list(dict.fromkeys(r["schedule"] for r in rows if r["kind"] == kind))
        points = sorted((np.mean([r["attention_fraction"] for r in rows if r["schedule"] == label]),
                         np.mean([r[metric] for r in rows if r["schedule"] == label]), label) for label in labels)
        for x, y, label in points:
            if label.endswith("all_attention"):
                ax.axhline(y, color=KIND_COLORS["all"], linestyle=":", label=f"all_attention ({y:.3f})")
        points = [(x, y) for x, y, label in points if not label.endswith("all_attention")]
        if points:
            x, y = np.array(points).T
            right = max(right, x.max())
            ax.plot(x, y, "s" if kind in ("all", "oracle") else "o-", color=KIND_COLORS[kind], markersize=5,
                    label="all_linear" if kind == "all" else kind)
    ax.set_xlim(-0.01, max(0.25, 1.3 * right))


def plot_curves(exp: Experiment, rows: List[dict], exp_dir: Path) -> Path:
    """Per (variant, model) a column, per switch direction a row: the switched schedule's gap to its target
    mode (``mode_switch.draw_gap``: trailing means restarting at the switch, which is marked), per-position
    losses averaged over seeds first."""
    from matplotlib.figure import Figure

    runs: Dict[tuple, List[str]] = {}
    for row in rows:
        names = runs.setdefault((row["variant"], row["model"]), [])
        if row["run"] not in names:
            names.append(row["run"])
    fig = Figure(figsize=(4.5 * len(runs), 6.5))
    axes = fig.subplots(len(mode_switch.TARGETS), len(runs), sharex=True, sharey="row", squeeze=False)
    switch_at, width = exp.eval.get("t"), exp.eval.get("smooth_width", 16)
    for column, ((variant, model), names) in enumerate(runs.items()):
        tables = [np.genfromtxt(exp_dir / "evals" / n / "mode_switch.csv", delimiter=",", names=True) for n in names]
        curves = {c: np.mean([t[f"loss_{c}"] for t in tables], axis=0) for c in mode_switch.CURVES}
        t = switch_at if switch_at is not None else len(tables[0]) // 2
        for ax, switch in zip(axes[:, column], mode_switch.TARGETS):
            mode_switch.draw_gap(ax, curves, t, switch, width)
            name = model if len(exp.variants) == 1 else f"{model} ({variant})"
            ax.set_title(f"{name}: {switch.replace('_to_', ' → ').replace('_', ' ')} at {t}", fontsize=9)
            ax.legend(fontsize=7)
            ax.grid(alpha=0.3)
    for ax in axes[:, 0]:
        ax.set_ylabel(f"gap to the target (nats), {width}-token\ntrailing mean, {len(exp.seeds)} seeds", fontsize=8)
    fig.tight_layout()
    path = exp_dir / "mode_switch.png"
    fig.savefig(path, dpi=120)
    return path
