"""The tables of an experiment's results: summaries over seeds, Markdown tables, the sweep table."""

from typing import Dict, List

import numpy as np

ROW_LABELS = ("schedule", "switch")  # the column that names a row of an eval result


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
