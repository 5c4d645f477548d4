"""Mode switching: per-position held-out loss when the mixer switches at position t.

Four schedules read the same held-out windows: all_attention, all_linear, attention -> linear
and linear -> attention at t (``switch_at``: positions < t in the first mode, >= t in the
second). The curve of a schedule is the mean loss at each position over the windows; the loss
at position p is that of predicting token p + 1 from the read of token p.

Convergence after a switch: both the switched curve and the target mode's single-mode curve
are smoothed by a trailing mean over ``smooth`` positions that never reaches back before t
(``smoothed[p] = mean(curve[max(t, p - smooth + 1) : p + 1])``). ``tokens_to_converge`` is the
smallest k >= 0 such that at every position p >= t + k up to the end of the window
``|smoothed_switch[p] - smoothed_target[p]| <= tolerance * smoothed_target[p]`` (k = 0: already
within at the switch token; None: not within by the end of the window).

CSV columns (one row per position): position, loss_all_attention, loss_all_linear,
loss_attention_to_linear, loss_linear_to_attention.
"""

import csv
from pathlib import Path
from typing import Dict, Optional

import numpy as np
from matplotlib.figure import Figure  # no pyplot: renders with Agg, no global backend

from oryx_megatron.config import Mode
from oryx_megatron.data.modes import all_attention, all_linear, switch_at
from oryx_megatron.eval.ppl import heldout_batches, token_losses
from oryx_megatron.training.config import TrainConfig

CURVES = ("all_attention", "all_linear", "attention_to_linear", "linear_to_attention")
CSV_COLUMNS = ("position",) + tuple(f"loss_{name}" for name in CURVES)
TARGETS = {"attention_to_linear": "all_linear", "linear_to_attention": "all_attention"}


def smooth(curve: np.ndarray, start: int, width: int) -> np.ndarray:
    """Trailing mean of ``width`` positions clipped at ``start``: [s] -> [s - start]."""
    tail = np.cumsum(np.concatenate([[0.0], curve[start:]]))
    ends = np.arange(1, tail.size)
    begins = np.maximum(ends - width, 0)
    return (tail[ends] - tail[begins]) / (ends - begins)


def tokens_to_converge(switched: np.ndarray, target: np.ndarray, t: int, width: int,
                       tolerance: float) -> Optional[int]:
    """Tokens after the switch at t until the smoothed switched curve stays within
    ``tolerance`` (relative) of the smoothed target curve (module docstring)."""
    s, g = smooth(switched, t, width), smooth(target, t, width)
    outside = np.flatnonzero(np.abs(s - g) > tolerance * g)
    if outside.size == 0:
        return 0
    k = int(outside[-1]) + 1
    return k if k < s.size else None


def write_csv(curves: Dict[str, np.ndarray], path: Path) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(CSV_COLUMNS)
        for p in range(len(curves[CURVES[0]])):
            writer.writerow([p] + [f"{curves[name][p]:.6f}" for name in CURVES])


def draw_curves(ax, curves: Dict[str, np.ndarray], t: int) -> None:
    """The four curves (single modes solid, switches dashed) and the switch position on ``ax``."""
    for name, style in zip(CURVES, ("-", "-", "--", "--")):
        ax.plot(curves[name], style, label=name.replace("_", " "), linewidth=1.2)
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
                         batch_size: int = 4, smooth_width: int = 16, tolerance: float = 0.05) -> dict:
    """Curves of the four schedules at switch position ``t`` (default seq_length // 2); writes
    ``out``/mode_switch.csv and .png; one row per switch direction."""
    seq_len = run.data.seq_length
    t = seq_len // 2 if t is None else t
    if not 0 < t < seq_len:
        raise ValueError(f"switch position {t} must be inside the window (0 < t < seq_length={seq_len})")
    schedules = dict(zip(CURVES, (all_attention(), all_linear(), switch_at(t, Mode.ATTENTION, Mode.LINEAR),
                                  switch_at(t, Mode.LINEAR, Mode.ATTENTION))))
    curves = {name: token_losses(model, heldout_batches(run, num_batches, batch_size, s)).mean(0).numpy()
              for name, s in schedules.items()}
    write_csv(curves, out / "mode_switch.csv")
    plot(curves, t, out / "mode_switch.png")
    rows = [dict(switch=name, target=target,
                 loss_after_switch=float(curves[name][t:].mean()), loss_target=float(curves[target][t:].mean()),
                 tokens_to_converge=tokens_to_converge(curves[name], curves[target], t, smooth_width, tolerance))
            for name, target in TARGETS.items()]
    return dict(task="mode_switch", switch_at=t, seq_length=seq_len, windows=num_batches * batch_size,
                smooth=smooth_width, tolerance=tolerance, csv="mode_switch.csv", png="mode_switch.png", rows=rows)
