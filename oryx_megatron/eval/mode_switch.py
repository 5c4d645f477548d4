"""Mode switching: per-position held-out loss when the mixer switches at position t.

Four schedules read the same held-out windows: all_attention, all_linear, attention -> linear
and linear -> attention at t (``switch_at``: positions < t in the first mode, >= t in the
second). The curve of a schedule is the mean loss at each position over the windows; the loss
at position p is that of predicting token p + 1 from the read of token p. With ``answers_only``
a position's loss is averaged over the windows whose loss mask holds it (MQAR: the answers,
where the two modes differ; a model trained on them alone predicts nothing elsewhere), and a
position no window scores has no value.

``mode_gap``: the difference between the two single-mode curves after the switch, in nats
(``|mean(all_attention[t:]) - mean(all_linear[t:])|``, over positions with a value). A switch
can only be seen converging where the modes differ, so the tolerance is a fraction of that gap.

Convergence after a switch: both the switched curve and the target mode's single-mode curve
are smoothed by a trailing mean over the valued positions among the last ``smooth`` that never
reaches back before t (``smoothed[p] = mean(curve[max(t, p - smooth + 1) : p + 1])``).
``tokens_to_converge`` is the smallest k >= 0 such that at every valued position p >= t + k up
to the end of the window ``|smoothed_switch[p] - smoothed_target[p]| <= tolerance * mode_gap``
(k = 0: already within at the switch token; None: not within at the last valued position).

CSV columns (one row per position, raw): position, loss_all_attention, loss_all_linear,
loss_attention_to_linear, loss_linear_to_attention. The PNG draws, per switch direction, the switched curve
against its target mode (``centered`` means on each side of the switch) and, below, their gap with the
convergence band (``gap_to_target``: exactly what ``tokens_to_converge`` tests).
"""

import csv
from pathlib import Path
from typing import Dict, List, Optional

import numpy as np
import torch
from matplotlib.figure import Figure  # no pyplot: renders with Agg, no global backend
from torch import Tensor

from oryx_megatron.config import Mode
from oryx_megatron.data.modes import all_attention, all_linear, switch_at
from oryx_megatron.data.schedules import RouterSchedule
from oryx_megatron.eval.ppl import schedule_batches, token_losses
from oryx_megatron.run_config import TrainConfig

CURVES = ("all_attention", "all_linear", "attention_to_linear", "linear_to_attention")
CSV_COLUMNS = ("position",) + tuple(f"loss_{name}" for name in CURVES)
TARGETS = {"attention_to_linear": "all_linear", "linear_to_attention": "all_attention"}


def window_means(values: np.ndarray, begins: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """The mean of the valued (not NaN) entries of each window ``values[begins[i]:ends[i]]``; NaN where a
    window holds no value."""
    valued = ~np.isnan(values)
    sums = np.cumsum(np.concatenate([[0.0], np.where(valued, values, 0.0)]))
    counts = np.cumsum(np.concatenate([[0], valued]))
    n = counts[ends] - counts[begins]
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(n > 0, (sums[ends] - sums[begins]) / n, np.nan)


def smooth(curve: np.ndarray, start: int, width: int) -> np.ndarray:
    """Trailing mean of the valued (not NaN) positions among the last ``width``, clipped at
    ``start``: [s] -> [s - start]; NaN where that window holds no value."""
    ends = np.arange(1, len(curve) - start + 1)
    return window_means(curve[start:], np.maximum(ends - width, 0), ends)


def tokens_to_converge(switched: np.ndarray, target: np.ndarray, t: int, width: int,
                       tolerance: float) -> Optional[int]:
    """Tokens after the switch at t until the smoothed switched curve stays within ``tolerance``
    nats of the smoothed target curve at every valued position (module docstring)."""
    s, g = smooth(switched, t, width), smooth(target, t, width)
    valued = np.flatnonzero(~np.isnan(s) & ~np.isnan(g))
    outside = valued[np.abs(s[valued] - g[valued]) > tolerance]
    if outside.size == 0:
        return 0
    return int(outside[-1]) + 1 if outside[-1] < valued[-1] else None


def mode_gap(curves: Dict[str, np.ndarray], t: int) -> float:
    """Nats between the single-mode curves after the switch (module docstring)."""
    return abs(float(np.nanmean(curves["all_attention"][t:]) - np.nanmean(curves["all_linear"][t:])))


def position_losses(losses: Tensor, mask: Optional[Tensor]) -> np.ndarray:
    """Mean loss per position over windows [n, s] -> [s]; with ``mask`` [n, s] over the masked
    windows only (NaN where none is)."""
    if mask is None:
        return losses.mean(0).numpy()
    counts = mask.sum(0)
    return torch.where(counts > 0, (losses * mask).sum(0) / counts.clamp_min(1), torch.nan).numpy()


def write_csv(curves: Dict[str, np.ndarray], path: Path) -> None:
    """CSV_COLUMNS, then a column per extra curve (a router schedule's)."""
    extra = [name for name in curves if name not in CURVES]
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(CSV_COLUMNS + tuple(f"loss_{name}" for name in extra))
        for p in range(len(curves[CURVES[0]])):
            writer.writerow([p] + [f"{curves[name][p]:.6f}" for name in (*CURVES, *extra)])


def centered(curve: np.ndarray, t: int, width: int) -> np.ndarray:
    """``curve`` [s] as the figure draws it: a centred mean over ``width`` positions, on each side of the
    switch at t separately (no point mixes both modes); NaN where the curve is (an unscored position)."""
    sides = []
    for side in (curve[:t], curve[t:]):
        p = np.arange(len(side))
        sides.append(window_means(side, np.maximum(p - width // 2, 0), np.minimum(p + width // 2 + 1, len(side))))
    return np.where(np.isnan(curve), np.nan, np.concatenate(sides))


def gap_to_target(curves: Dict[str, np.ndarray], t: int, name: str, target: str, width: int) -> np.ndarray:
    """Curve ``name`` minus curve ``target``, each a trailing mean (``smooth``) restarting at the switch: for a
    switched schedule and its target mode, what ``tokens_to_converge`` holds within the band after t."""
    return np.concatenate([smooth(curves[name], 0, width)[:t] - smooth(curves[target], 0, width)[:t],
                           smooth(curves[name], t, width) - smooth(curves[target], t, width)])


def plot_valued(ax, y: np.ndarray, style: str, **kwargs) -> None:
    """``y`` [s] against its positions on ``ax``, the NaN ones (unscored, e.g. not an answer) left out and the
    others joined; marked where they are sparse."""
    x = np.flatnonzero(~np.isnan(y))
    ax.plot(x, y[x], style, marker="." if x.size < 0.5 * y.size else None, markersize=4, **kwargs)


def draw_switch(ax, curves: Dict[str, np.ndarray], t: int, switch: str, width: int) -> None:
    """One switched schedule (dashed) against its target mode (solid), with the mode it leaves (faint),
    smoothed (``centered``), the switch marked."""
    target = TARGETS[switch]
    source = next(name for name in TARGETS.values() if name != target)
    for name, style, color, alpha in ((source, "-", "gray", 0.6), (target, "-", "C0", 1.0), (switch, "--", "C3", 1.0)):
        plot_valued(ax, centered(curves[name], t, width), style, color=color, alpha=alpha, linewidth=1.4,
                    label=name.replace("_", " "))
    ax.axvline(t, color="black", linestyle=":", linewidth=1, label=f"switch at {t}")
    ax.set_title(switch.replace("_to_", " → ").replace("_", " "), fontsize=10)


def draw_gap(ax, curves: Dict[str, np.ndarray], t: int, switch: str, width: int,
             tolerance_nats: Optional[float] = None) -> None:
    """``gap_to_target`` of the switched schedule (dashed) and, faint, of the mode it leaves (the gap it
    closes), against 0 (the target), the switch marked; with ``tolerance_nats`` the convergence band after
    it. The windows' shared content noise cancels in the differences."""
    target = TARGETS[switch]
    source = next(name for name in TARGETS.values() if name != target)
    for name, style, color, alpha in ((source, "-", "gray", 0.6), (switch, "--", "C3", 1.0)):
        plot_valued(ax, gap_to_target(curves, t, name, target, width), style, color=color, alpha=alpha,
                    linewidth=1.4, label=f"{name.replace('_', ' ')} − {target.replace('_', ' ')}")
    ax.axhline(0, color="C0", linewidth=1)
    if tolerance_nats is not None:
        x = np.arange(t, len(curves[target]))
        ax.fill_between(x, -tolerance_nats, tolerance_nats, color="C0", alpha=0.2,
                        label=f"band ± {tolerance_nats:.3f} nats")
    ax.axvline(t, color="black", linestyle=":", linewidth=1)
    ax.set_xlabel("position")


def draw_extras(ax, curves: Dict[str, np.ndarray], width: int) -> None:
    """The curves beyond the four (a router schedule's, dotted) against both single modes, smoothed."""
    for name in curves:
        if name not in CURVES[2:]:
            plot_valued(ax, centered(curves[name], 0, width), "-" if name in CURVES else ":", linewidth=1.4,
                        label=name.replace("_", " "))
    ax.set_xlabel("position")
    ax.set_title("router schedules", fontsize=10)


def switch_figure(curves: Dict[str, np.ndarray], t: int, width: int, rows: List[dict],
                  tolerance_nats: float) -> Figure:
    """A column per switch direction: above, the curves (``draw_switch``), titled with the tokens to converge;
    below, the gap to the target with the band (``draw_gap``). A column for any extra curve. The raw
    per-position losses are in the CSV."""
    extra = any(name not in CURVES for name in curves)
    fig = Figure(figsize=(5 * (len(TARGETS) + extra), 6.5))
    axes = fig.subplots(2, len(TARGETS) + extra, sharex=True, height_ratios=(3, 2), squeeze=False)
    for column, row in enumerate(rows):
        draw_switch(axes[0, column], curves, t, row["switch"], width)
        draw_gap(axes[1, column], curves, t, row["switch"], width, tolerance_nats)
        k = row["tokens_to_converge"]
        axes[0, column].set_title(f"{axes[0, column].get_title()}: " + (
            f"within the band {k} token{'s' * (k != 1)} after the switch" if k is not None
            else "not within the band by the end"), fontsize=9)
    if extra:
        draw_extras(axes[0, -1], curves, width)
        axes[0, -1].tick_params(labelbottom=True)
        axes[1, -1].set_axis_off()
    axes[0, 0].set_ylabel(f"held-out loss (nats), {width}-token centred mean", fontsize=9)
    axes[1, 0].set_ylabel(f"gap to the target (nats),\n{width}-token trailing mean", fontsize=9)
    for ax in axes.flat:
        if ax.axison:
            ax.legend(fontsize=8)
            ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def evaluate_mode_switch(model, run: TrainConfig, out: Path, t: Optional[int] = None, num_batches: int = 8,
                         batch_size: int = 4, smooth_width: int = 16, tolerance: float = 0.1,
                         answers_only: bool = False, router: Optional[RouterSchedule] = None) -> dict:
    """Curves of the four schedules at switch position ``t`` (default seq_length // 2), and of
    ``router`` (a router schedule) beside them; writes ``out``/mode_switch.csv and .png; one row per
    switch direction. ``tolerance``: the convergence band as a fraction of ``mode_gap``;
    ``answers_only``: score the loss mask's positions only (module docstring)."""
    seq_len = run.data.seq_length
    t = seq_len // 2 if t is None else t
    if not 0 < t < seq_len:
        raise ValueError(f"switch position {t} must be inside the window (0 < t < seq_length={seq_len})")
    schedules = dict(zip(CURVES, (all_attention(), all_linear(), switch_at(t, Mode.ATTENTION, Mode.LINEAR),
                                  switch_at(t, Mode.LINEAR, Mode.ATTENTION))))
    if router is not None:
        schedules[str(router)] = router
    curves = {}
    for name, schedule in schedules.items():
        batches = schedule_batches(model, run, num_batches, batch_size, schedule)
        mask = torch.cat([b["loss_mask"] for b in batches]) if answers_only else None
        curves[name] = position_losses(token_losses(model, batches), mask)
    write_csv(curves, out / "mode_switch.csv")
    gap = mode_gap(curves, t)
    rows = [dict(switch=name, target=target, mode_gap=gap,
                 loss_after_switch=float(np.nanmean(curves[name][t:])),
                 loss_target=float(np.nanmean(curves[target][t:])),
                 tokens_to_converge=tokens_to_converge(curves[name], curves[target], t, smooth_width, tolerance * gap))
            for name, target in TARGETS.items()]
    switch_figure(curves, t, smooth_width, rows, tolerance * gap).savefig(out / "mode_switch.png", dpi=120)
    return dict(task="mode_switch", switch_at=t, seq_length=seq_len, windows=num_batches * batch_size,
                smooth=smooth_width, tolerance=tolerance, tolerance_nats=tolerance * gap, answers_only=answers_only,
                csv="mode_switch.csv", png="mode_switch.png", rows=rows)
