"""The chaos run against the reference: loss curves (the last row logged per iteration) and every
tensor of the two final checkpoints (model weights, optimizer moments) plus the common state; and whether
the chaos run's final checkpoint matches its checksums."""

import math
from pathlib import Path
from typing import Dict, List, Tuple

from oryx_megatron.checks.chaos.watch import parse_row

RUN_IDS = {"run_id"}  # common-state keys that differ between any two runs


def loss_curve(metrics_files: List[Path]) -> Tuple[Dict[int, float], int]:
    """iteration -> loss, the LAST row logged for each iteration across the files in order; and how many
    earlier rows (steps that were redone) disagree with the row that replaced them."""
    curve, mismatched = {}, 0
    for path in metrics_files:
        if not path.exists():
            continue
        for line in path.read_text().splitlines():
            row = parse_row(line)
            if row is None or "train/loss" not in row:
                continue
            it = row["iteration"]
            if it in curve and curve[it] != row["train/loss"]:
                mismatched += 1
            curve[it] = row["train/loss"]
    return curve, mismatched


def checkpoint_tensors(path: Path) -> dict:
    """Every tensor of a distributed checkpoint (model and optimizer), flat, without a process group."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    state: dict = {}
    _load_state_dict(state, storage_reader=FileSystemReader(str(path)), planner=_EmptyStateDictLoadPlanner(),
                     no_dist=True)
    flat = {}

    def walk(value, prefix):
        if isinstance(value, dict):
            for k, v in value.items():
                walk(v, f"{prefix}{k}/")
        else:
            flat[prefix.rstrip("/")] = value

    walk(state, "")
    return flat


def _max_diff(a, b) -> float:
    """Max |a - b| over nested tensors / numbers / containers; inf when the structures differ."""
    import torch

    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)) or a.shape != b.shape:
            return math.inf
        if a.numel() == 0:
            return 0.0
        if a.dtype.is_floating_point or b.dtype.is_floating_point:
            return float((a.double() - b.double()).abs().max())
        return 0.0 if torch.equal(a, b) else math.inf
    if isinstance(a, dict) and isinstance(b, dict):
        if set(a) != set(b):
            return math.inf
        return max((_max_diff(a[k], b[k]) for k in a), default=0.0)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return math.inf
        return max((_max_diff(x, y) for x, y in zip(a, b)), default=0.0)
    if isinstance(a, float) and isinstance(b, float):
        return 0.0 if a == b or (a != a and b != b) else abs(a - b)
    return 0.0 if a == b else math.inf


def compare_checkpoints(ref: Path, got: Path) -> dict:
    import torch

    from oryx_megatron.checkpoint import load_common

    a, b = checkpoint_tensors(ref), checkpoint_tensors(got)
    tensors = [k for k in a if isinstance(a[k], torch.Tensor)]
    model = [k for k in tensors if not k.startswith(("optimizer", "rng_state"))]
    missing = sorted(set(a) ^ set(b))
    diffs = {k: _max_diff(a[k], b.get(k)) for k in tensors}
    common_a, common_b = load_common(ref), load_common(got)
    return {
        "tensors_compared": len(tensors),
        "model_tensors_compared": len(model),
        "keys_only_in_one": missing,
        "max_weight_diff": max((diffs[k] for k in model), default=math.inf),
        "max_tensor_diff": max(diffs.values(), default=math.inf),  # model + optimizer moments (+ RNG)
        "worst_tensor": max(diffs, key=diffs.get) if diffs else None,
        # iteration, scheduler, loader, optimizer step, layout; not the ids that name a run (they differ)
        "common_state_diff": _max_diff(*({k: c[k] for k in set(common_a) & set(common_b) - RUN_IDS}
                                         for c in (common_a, common_b))),
        "common_keys_only_in_one": sorted(set(common_a) ^ set(common_b)),
        "checksums_match": checksums_match(got),
    }


def checksums_match(path: Path) -> bool:
    """Whether every file of the checkpoint at ``path`` matches its checksum (False without a checksum file)."""
    from oryx_megatron.checkpoint import CheckpointError, verify_checksums

    try:
        return verify_checksums(path)
    except CheckpointError:
        return False
