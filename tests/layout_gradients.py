"""A training run's gradients in a layout-free form, for tests/test_layout_gradients.py: ``pretrain`` with
the first step's reduced gradients (what clipping and the optimizer see) saved as a distributed checkpoint
of the model, which loads at any TP / PP / CP / DP layout as the weights do."""

import math
from pathlib import Path
from typing import Dict, List

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing
from megatron.core.distributed.param_and_grad_buffer import shard_buffer

from oryx_megatron.checks.chaos.compare import checkpoint_tensors
from oryx_megatron.training import loop


def gather_reduce_scattered_grads(chunk) -> None:
    """Under the distributed optimizer each data-parallel rank's grad buffer holds the reduced gradient of
    its shard only (megatron reduce-scatters): all-gather the shards, so every rank holds the whole of it."""
    for group in chunk.bucket_groups + chunk.expert_parallel_bucket_groups:
        if not group.ddp_config.use_distributed_optimizer:
            continue
        size, rank = group.intra_distributed_optimizer_instance_size, group.intra_distributed_optimizer_instance_rank
        for bucket in group.buckets:
            shard = shard_buffer(bucket.grad_data, size)[rank].clone()
            dist.all_gather_into_tensor(bucket.grad_data, shard, group=group.intra_distributed_optimizer_instance_group)


def save_gradients(model_chunks, path: str) -> None:
    """Every parameter's ``main_grad`` saved in place of its weights (the model's sharded state dict, as a
    checkpoint saves it); the weights are untouched."""
    for chunk in model_chunks:
        gather_reduce_scattered_grads(chunk)
    params = [p for chunk in model_chunks for p in chunk.module.parameters()]
    weights = [p.data for p in params]
    if dist.get_rank() == 0:
        Path(path).mkdir(parents=True)
    dist.barrier()
    try:
        for p in params:
            p.data = p.main_grad
        state = {f"model{i}": chunk.module.sharded_state_dict() for i, chunk in enumerate(model_chunks)}
        dist_checkpointing.save(state, path)
    finally:
        for p, w in zip(params, weights):
            p.data = w


def pretrain_saving_first_gradients(run, output_dir: str, grads_dir: str) -> int:
    """``pretrain(run, output_dir)``, the first training step's gradients saved to ``grads_dir`` between the
    backward (with its DP / CP / TP reductions and the per-token normalisation) and clipping."""
    forward_backward, steps = loop.forward_backward, []

    def recording(run_, model, loaders, forward_only, routing=None):
        reports = forward_backward(run_, model, loaders, forward_only, routing)
        if not forward_only and not steps:
            save_gradients(model, grads_dir)
        steps.extend([] if forward_only else [1])
        return reports

    loop.forward_backward = recording
    try:
        return loop.pretrain(run, output_dir)
    finally:
        loop.forward_backward = forward_backward


def relative_errors(got: str, want: str) -> Dict[str, float]:
    """Per tensor of two gradient checkpoints: ||got - want|| / ||want|| (fp64); inf where a tensor is
    missing or shaped otherwise."""
    a, b = checkpoint_tensors(Path(got)), checkpoint_tensors(Path(want))
    errors = {}
    for key in sorted(set(a) | set(b)):
        x, y = a.get(key), b.get(key)
        if not (isinstance(x, torch.Tensor) and x.is_floating_point()) and not (
                isinstance(y, torch.Tensor) and y.is_floating_point()):
            continue
        if not isinstance(x, torch.Tensor) or not isinstance(y, torch.Tensor) or x.shape != y.shape:
            errors[key] = math.inf
            continue
        scale = y.double().norm().item()
        diff = (x.double() - y.double()).norm().item()
        errors[key] = diff / scale if scale else diff
    return errors


def norm_errors(got: List[float], want: List[float]) -> List[float]:
    """|got - want| / want of each step's gradient norm."""
    assert len(got) == len(want), (got, want)
    return [abs(g - w) / w for g, w in zip(got, want)]
