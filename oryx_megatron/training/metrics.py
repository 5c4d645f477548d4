"""Training metrics: the console line, W&B (never fatal), and the loss-curve PNG."""

import json
import logging
import math
from pathlib import Path
from typing import Dict, List, Optional

import torch

from oryx_megatron.source import git_source

logger = logging.getLogger("oryx_megatron.train")


def memory_gb() -> float:
    """Peak device memory (CUDA) or this process's peak RSS (CPU), in GB."""
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**30
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


class MetricsLogger:
    """Console + metrics.jsonl + W&B + the loss curve; active on the logging rank only.

    ``start`` (called by ``Trainer.resume``) begins the run's records at the iteration training
    continues from: rows of later iterations are dropped from ``metrics.jsonl`` (they were never
    checkpointed and are about to be logged again), and W&B continues the run ``run_id`` (stored
    in the checkpoint) with ``resume="allow"``. The loss curve is drawn from the whole
    ``metrics.jsonl``: one curve across resumes into the same output directory."""

    def __init__(self, active: bool, logging_config, output_dir: Path, run_config: dict):
        self.active, self.output_dir = active, Path(output_dir)
        if active:
            self.output_dir.mkdir(parents=True, exist_ok=True)
        self.logging_config, self.run_config = logging_config, run_config
        self.history: List[Dict[str, float]] = []
        self.wandb = None
        self.started = False

    @property
    def path(self) -> Path:
        return self.output_dir / "metrics.jsonl"

    def start(self, iteration: Optional[int] = None, run_id: Optional[str] = None) -> None:
        """Begin logging at ``iteration`` (None: keep every row already in metrics.jsonl); W&B
        run ``run_id`` (None: a new one)."""
        self.started = True
        if not self.active:
            return
        if iteration is not None:
            self._truncate_after(iteration)
        if self.logging_config.wandb_mode == "disabled":
            return
        try:
            import wandb

            self.wandb = wandb.init(
                mode=self.logging_config.wandb_mode,
                project=self.logging_config.wandb_project,
                entity=self.logging_config.wandb_entity,
                name=self.logging_config.run_name,
                dir=str(self.output_dir),
                config={**self.run_config, "source": git_source()},
                id=run_id,
                resume="allow",
            )
        except Exception as e:  # W&B must never kill training
            logger.warning("W&B disabled: init failed (%r)", e)

    def _truncate_after(self, iteration: int) -> None:
        rows = read_rows(self.path)
        kept = [row for row in rows if row.get("iteration", 0) <= iteration]
        if len(kept) == len(rows):
            return
        tmp = self.path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(json.dumps(row) + "\n" for row in kept))
        tmp.replace(self.path)
        logger.info("%s: dropped %d rows after iteration %d (not in the checkpoint resumed from)",
                    self.path, len(rows) - len(kept), iteration)

    def log(self, iteration: int, metrics: Dict[str, float], console: bool = True) -> None:
        if not self.started:
            self.start()
        if not self.active:
            return
        self.history.append({"iteration": iteration, **metrics})
        with open(self.path, "a") as f:
            f.write(json.dumps({"iteration": iteration, **metrics}) + "\n")
        if console:
            logger.info(format_line(iteration, metrics))
        if self.wandb is not None:
            try:
                self.wandb.log(metrics, step=iteration)
            except Exception as e:
                logger.warning("W&B disabled: log failed (%r)", e)
                self.wandb = None

    def finish(self) -> Optional[Path]:
        """Write the loss curve PNG (every row of metrics.jsonl); close W&B. Returns the PNG path."""
        if not self.active:
            return None
        png = plot_loss_curve(read_rows(self.path) or self.history, self.output_dir / "loss_curve.png")
        if self.wandb is not None:
            try:
                logger.info("W&B run (%s): %s", self.wandb.settings.mode, Path(self.wandb.dir).parent)
                self.wandb.finish()
            except Exception as e:
                logger.warning("W&B finish failed (%r)", e)
        return png


def read_rows(path: Path) -> List[dict]:
    """The rows of a metrics.jsonl (none when it is missing); a torn last line is skipped."""
    if not Path(path).exists():
        return []
    rows = []
    for line in Path(path).read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


def format_line(iteration: int, m: Dict[str, float]) -> str:
    parts = [f"iter {iteration:>6}"]
    for key, fmt in (("train/loss", ".4f"), ("train/loss_attention", ".4f"), ("train/loss_linear", ".4f"),
                     ("train/attention_fraction", ".2f"), ("train/lr", ".2e"), ("train/grad_norm", ".3f"),
                     ("perf/tokens_per_s", ",.0f"), ("perf/tflops", ".2f"), ("perf/mfu", ".2%"),
                     ("perf/memory_gb", ".2f")):
        if key in m and m[key] is not None and not (isinstance(m[key], float) and math.isnan(m[key])):
            parts.append(f"{key.split('/')[1]} {m[key]:{fmt}}")
    parts += [f"{k} {v:.4f}" for k, v in m.items() if k.startswith("eval/")]
    return " | ".join(parts)


COUNTERS = ("train/loss_spikes", "train/skipped_steps")  # events per log interval: their own panel, not nats


def plot_loss_curve(history: List[Dict[str, float]], path: Path) -> Optional[Path]:
    """``loss_curve_figure`` as a PNG at ``path`` (None: nothing to draw)."""
    fig = loss_curve_figure(history)
    if fig is None:
        return None
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    return path


def loss_curve_figure(history: List[Dict[str, float]]):
    """Training loss (overall and per mode) and eval losses against iterations; below, on their own axis,
    the counters (loss spikes and skipped steps per log interval). None without a loss."""
    from matplotlib.figure import Figure  # no pyplot: renders with Agg, no global backend

    keys = sorted({k for row in history for k in row if k.startswith(("train/loss", "eval/")) and k not in COUNTERS})
    if not keys:
        return None
    fig = Figure(figsize=(7, 5))
    ax, counts = fig.subplots(2, 1, sharex=True, height_ratios=(4, 1))
    for key in keys:
        points = [(row["iteration"], row[key]) for row in history if key in row and row[key] == row[key]]
        if points:
            style = "o--" if key.startswith("eval/") else "-"
            ax.plot(*zip(*points), style, label=key, markersize=3)
    ax.set_ylabel("loss (nats/token)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    events = {key: [(row["iteration"], row[key]) for row in history if row.get(key)] for key in COUNTERS}
    for (key, points), marker in zip(events.items(), "x+"):
        if points:
            counts.plot(*zip(*points), marker, label=key, markersize=6)
    if any(events.values()):
        counts.legend(fontsize=8)
    else:
        counts.text(0.5, 0.5, "no loss spikes, no skipped steps", transform=counts.transAxes, ha="center",
                    va="center", fontsize=8, color="gray")
    counts.set_ylabel("events", fontsize=8)
    counts.set_ylim(0, 1.3 * max([1] + [n for points in events.values() for _, n in points]))
    counts.yaxis.get_major_locator().set_params(integer=True)
    counts.set_xlabel("iteration")
    counts.grid(alpha=0.3)
    fig.tight_layout()
    return fig
