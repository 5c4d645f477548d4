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

CSV columns (one row per position): position, loss_all_attention, loss_all_linear,
loss_attention_to_linear, loss_linear_to_attention.
"""

import csv
from pathlib import Path
from typing import Dict, Optional

import numpy as np
import torch
from matplotlib.figure import Figure  # no pyplot: renders with Agg, no global backend
from torch import Tensor

from oryx_megatron.config import Mode
from oryx_megatron.data.modes import all_attention, all_linear, switch_at
from oryx_megatron.eval.ppl import schedule_batches, token_losses
from oryx_megatron.inference.schedules import RouterSchedule
from oryx_megatron.run_config import TrainConfig

CURVES = ("all_attention", "all_linear", "attention_to_linear", "linear_to_attention")
CSV_COLUMNS = ("position",) + tuple(f"loss_{name}" for name in CURVES)
TARGETS = {"attention_to_linear": "all_linear", "linear_to_attention": "all_attention"}


def smooth(curve: np.ndarray, start: int, width: int) -> np.ndarray:
    """Trailing mean of the valued (not NaN) positions among the last ``width``, clipped at
    ``start``: [s] -> [s - start]; NaN where that window holds no value."""
    tail = curve[start:]
    valued = ~np.isnan(tail)
    sums = np.cumsum(np.concatenate([[0.0], np.where(valued, tail, 0.0)]))
    counts = np.cumsum(np.concatenate([[0], valued]))
    ends = np.arange(1, sums.size)
    begins = np.maximum(ends - width, 0)
    n = counts[ends] - counts[begins]
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(n > 0, (sums[ends] - sums[begins]) / n, np.nan)


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


def draw_curves(ax, curves: Dict[str, np.ndarray], t: int) -> None:
    """The four curves (single modes solid, switches dashed, extra ones dotted) and the switch position
    on ``ax``."""
    extra = [name for name in curves if name not in CURVES]
    for name, style in zip((*CURVES, *extra), ("-", "-", "--", "--", *(":" for _ in extra))):
        x = np.flatnonzero(~np.isnan(curves[name]))  # the positions with a loss (answers_only: the answers)
        ax.plot(x, curves[name][x], style, label=name.replace("_", " "), linewidth=1.2)
    ax.axvline(t, color="gray", linestyle=":", label=f"switch at {t}")
    ax.set(xlabel="position")


def plot(curves: Dict[str, np.ndarray], t: int, path: Path) -> None:
    fig = Figure(figsize=(8, 4.5))
    ax = fig.subplots()
    draw_curves(ax, curves, t)
    ax.set(ylabel="mean held-out loss (nats)", title="Mode switching")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


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
    plot(curves, t, out / "mode_switch.png")
    gap = mode_gap(curves, t)
    rows = [dict(switch=name, target=target, mode_gap=gap,
                 loss_after_switch=float(np.nanmean(curves[name][t:])),
                 loss_target=float(np.nanmean(curves[target][t:])),
                 tokens_to_converge=tokens_to_converge(curves[name], curves[target], t, smooth_width, tolerance * gap))
            for name, target in TARGETS.items()]
    return dict(task="mode_switch", switch_at=t, seq_length=seq_len, windows=num_batches * batch_size,
                smooth=smooth_width, tolerance=tolerance, tolerance_nats=tolerance * gap, answers_only=answers_only,
                csv="mode_switch.csv", png="mode_switch.png", rows=rows)
