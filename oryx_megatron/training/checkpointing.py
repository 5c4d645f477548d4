"""What a training run's checkpoint holds and how it is restored: distributed checkpoints
(megatron.core.dist_checkpointing) of the model, optimizer, scheduler, loader and RNG, in the layout of
``oryx_megatron.checkpoint``. Saving them: ``saving``.

A checkpoint saved at one TP/PP layout loads at another (the model and optimizer are sharded tensors; the
distributed optimizer's state in megatron's ``fully_reshardable`` format, ``OPTIMIZER_FORMAT``); the RNG states
are restored only at the layout they were saved at.
"""

from pathlib import Path
from typing import List, Optional

import torch
from megatron.core import parallel_state
from megatron.core.dist_checkpointing.mapping import ShardedObject
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
from megatron.core.tensor_parallel import get_cuda_rng_tracker

from oryx_megatron.checkpoint import FORMAT_VERSION, load_common, load_sharded, verify_checkpoint
from oryx_megatron.parallel import context_parallel

OPTIMIZER_FORMAT = "fully_reshardable"  # the distributed optimizer's: loads at any layout (docs/training.md)
OPTIMIZER_METADATA = {"distrib_optim_sharding_type": OPTIMIZER_FORMAT}


def _layout() -> List[int]:
    """[PP, TP, DP] sizes, and CP's when above 1 (the layouts of checkpoints written before it compare equal)."""
    cp = parallel_state.get_context_parallel_world_size()
    return [
        parallel_state.get_pipeline_model_parallel_world_size(),
        parallel_state.get_tensor_model_parallel_world_size(),
        parallel_state.get_data_parallel_world_size(),
    ] + ([cp] if cp > 1 else [])


def _rng_state() -> ShardedObject:
    """This rank's RNG states, one shard per (pp, tp, dp[, cp]) coordinate."""
    state = {
        "cpu": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
        "tracker": get_cuda_rng_tracker().get_states(),
    }
    coordinates = [
        parallel_state.get_pipeline_model_parallel_rank(),
        parallel_state.get_tensor_model_parallel_rank(),
        parallel_state.get_data_parallel_rank(),
    ] + ([parallel_state.get_context_parallel_rank()] if context_parallel() else [])
    return ShardedObject("rng_state", state, tuple(_layout()), tuple(coordinates), replica_id=0)


def _sharded_state(model_chunks, optimizer, is_loading: bool, with_rng: bool) -> dict:
    state = {}  # keys of the unwrapped model (no DDP "module." prefix): a bare model loads them
    for i, chunk in enumerate(model_chunks):
        state["model" if len(model_chunks) == 1 else f"model{i}"] = chunk.module.sharded_state_dict()
    model_state = {k: v for k, v in state.items() if k.startswith("model")}
    state["optimizer"] = optimizer.sharded_state_dict(model_state, is_loading=is_loading, metadata=OPTIMIZER_METADATA)
    if not is_loading:
        _realign_saved_param_state(optimizer, state["optimizer"])
    if with_rng:
        state["rng_state"] = _rng_state()
    return state


def _chained(optimizer) -> List:
    """The megatron optimizers that ``optimizer`` chains (itself when it is not a ChainedOptimizer)."""
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def _per_optimizer(state: dict) -> List[dict]:
    """The state of each chained optimizer: a ChainedOptimizer's is its one optimizer's, or {index: state}."""
    return [state[i] for i in sorted(state)] if all(isinstance(k, int) for k in state) else [state]


def _check_optimizer_state(path: Path, common: dict, optimizer) -> None:
    """One line (ConfigError) instead of megatron's deep traceback when the checkpoint's optimizer state
    is not one this run's optimizer loads: a non-distributed optimizer's for a non-distributed one, the
    distributed optimizer's in OPTIMIZER_FORMAT (at any layout) for the distributed one."""
    from oryx_megatron.run_config import ConfigError

    saved = _per_optimizer(common["optimizer"])[0].get("param_state_sharding_type")  # None: not distributed
    distributed = any(isinstance(opt, DistributedOptimizer) for opt in _chained(optimizer))
    key = "config key 'optimizer.use_distributed_optimizer'"
    if distributed and saved is None:
        raise ConfigError(f"{key}: true, but checkpoint {path} holds a non-distributed optimizer's state: "
                          "resume it with false")
    if not distributed and saved is not None:
        raise ConfigError(f"{key}: false, but checkpoint {path} holds the distributed optimizer's state "
                          f"({saved!r}): resume it with true")
    if distributed and saved != OPTIMIZER_FORMAT:
        layouts = ["PP={} TP={} DP={}".format(*layout) for layout in (common["layout"], _layout())]
        raise ConfigError(f"checkpoint {path}: the distributed optimizer's state is in megatron's {saved!r} "
                          f"format (saved at {layouts[0]}); oryx-train loads only {OPTIMIZER_FORMAT!r}, at any "
                          f"layout (this run: {layouts[1]})")


def _realign_saved_param_state(optimizer, state: dict) -> None:
    """Correct the parameter state that megatron's fully_reshardable save put in ``state`` (the
    optimizer's sharded state dict). megatron-core (0.16 to 0.19; Megatron-LM PR #5077) slices a grad
    buffer's DP-gathered state, which ``get_parameter_state_dp_zero`` packs without the padding at the
    end of each bucket, at the buffer's own offsets (``param_index_map``), which count that padding: every
    parameter after a padded bucket end is saved from the wrong place (with PP > 1 the tied embedding or
    output layer, which has a bucket of its own; with overlap_grad_reduce, whatever lies beyond the first
    bucket). Where a buffer has such padding, the state is gathered again and each parameter's tensors
    are replaced by its own slice; elsewhere nothing happens."""
    for opt, opt_state in zip(_chained(optimizer), _per_optimizer(state)):
        if not isinstance(opt, DistributedOptimizer):
            continue
        paddings = [[b.grad_data.numel() - b.numel_unpadded for b in buffer.buckets] for buffer in opt.buffers]
        if not any(sum(padding[:-1]) for padding in paddings):
            continue
        param_state = opt_state["param_state"]  # {param_idx: {"param" / "exp_avg" / ...: ShardedTensor}}
        shapes = {}
        for idx, entries in param_state.items():  # megatron's misplaced copy goes before ours is gathered
            for key, sharded in entries.items():
                shapes[idx, key], sharded.data = sharded.data.shape, None
        world = opt.get_parameter_state_dp_zero(use_gloo_comm=False, return_on_all_ranks=True)
        param_idx = 0  # megatron's numbering of the parameter state: buffers, then param_index_map, in order
        for gbuf_idx, (buffer, padding) in enumerate(zip(opt.buffers, paddings)):
            (tensors,) = world[gbuf_idx].values()  # one dtype per buffer: {"param": [numel_unpadded], ...}
            for start, end, bucket in buffer.param_index_map.values():
                stripped = sum(padding[:bucket])  # padding that the packing removed before this bucket
                for key, sharded in param_state[param_idx].items():
                    sharded.data = tensors[key][start - stripped:end - stripped].view(shapes[param_idx, key])
                param_idx += 1


def _over_torch_adam(optimizer) -> List:
    """The DistributedOptimizers among ``optimizer``'s chained ones that run torch's Adam (no TE/apex
    FusedAdam): torch's Adam keeps a ``step`` tensor per parameter, FusedAdam one per param group, and
    megatron's checkpoint code for them has three gaps that ``_init_fresh_adam`` and
    ``_load_optimizer`` close."""
    return [opt for opt in _chained(optimizer)
            if isinstance(opt, DistributedOptimizer) and type(opt.optimizer) in (torch.optim.Adam, torch.optim.AdamW)]


def _init_fresh_adam(optimizer) -> None:
    """Before a load: megatron's ``sharded_state_dict`` reads the step from the per-parameter state,
    which a never-stepped torch Adam lacks (AssertionError): zero moments at step 0 (the load
    overwrites them)."""
    for opt in _over_torch_adam(optimizer):
        if not opt.optimizer.state:
            opt.init_state_fn(opt.optimizer, opt.config)
            for param_state in opt.optimizer.state.values():
                param_state["step"] = torch.tensor(0.0)


def _load_optimizer(optimizer, state: dict) -> None:
    """``optimizer.load_state_dict(state)``; a DistributedOptimizer over torch's Adam loads in two parts:
    megatron's ``load_state_dict`` without the parameter state (param groups, grad scaler), then the
    parameter state with torch's ``step`` entries held aside, because megatron's parameter-state load
    copies every entry of torch's state and the checkpoint keeps the step only in the param groups
    (KeyError 'step'); each parameter then gets its own step tensor (megatron gives all of them one,
    which torch's Adam increments once per parameter). megatron's other optimizers save no step of 0
    (a checkpoint of a run that never stepped, ``oryx-import``'s): its parameters get step 0."""
    over_torch_adam = _over_torch_adam(optimizer)
    if not over_torch_adam:
        for opt_state in _per_optimizer(state):  # megatron saves no step of 0: torch's Adam needs one
            for param_state in opt_state.get("optimizer", opt_state).get("state", {}).values():
                if isinstance(param_state, dict) and "exp_avg" in param_state:
                    param_state.setdefault("step", torch.tensor(0.0))
        optimizer.load_state_dict(state)
        return
    for opt, opt_state in zip(over_torch_adam, _per_optimizer(state)):
        param_state = opt_state.pop("param_state")
        del opt_state["param_state_sharding_type"]  # OPTIMIZER_FORMAT (_check_optimizer_state)
        opt.load_state_dict(opt_state)
        step = float(opt_state["optimizer"]["param_groups"][0]["step"])
        adam_state = opt.optimizer.state.values()
        for param_state_of_adam in adam_state:
            del param_state_of_adam["step"]
        opt.load_parameter_state_from_fully_reshardable(param_state)
        for param_state_of_adam in adam_state:
            param_state_of_adam["step"] = torch.tensor(step)


def run_state(model_chunks, optimizer, scheduler, loader, iteration: int, extra: Optional[dict] = None) -> dict:
    """What a checkpoint of ``iteration`` holds (every rank's part): the sharded model, optimizer and RNG
    states, and the common state: iteration, LR schedule, loader, layout, ``format_version`` and ``extra`` (a
    training run's: the W&B run id and the code's ``source``; ``compat.megatron`` says where it is written)."""
    state = _sharded_state(model_chunks, optimizer, is_loading=False, with_rng=True)
    state.update(
        iteration=iteration,
        scheduler=scheduler.state_dict(),
        loader=loader.state_dict(),
        layout=_layout(),
        format_version=FORMAT_VERSION,
        **(extra or {}),
    )
    return state


def load_checkpoint(path: Path, model_chunks, optimizer, scheduler, loader) -> int:
    """Restore everything saved at `path`; returns the iteration to continue from. Every rank verifies
    its structure first (what megatron will unpickle); its bytes were checked against their checksums
    by rank 0 when ``Trainer.resume`` chose it (``latest_checkpoint``), once for all ranks."""
    verify_checkpoint(path, checksums=False)
    common = load_common(path)
    same_layout = common["layout"] == _layout()
    _check_optimizer_state(path, common, optimizer)
    _init_fresh_adam(optimizer)
    state = load_sharded(_sharded_state(model_chunks, optimizer, is_loading=True, with_rng=same_layout), path)
    for i, chunk in enumerate(model_chunks):
        chunk.module.load_state_dict(state["model" if len(model_chunks) == 1 else f"model{i}"])
    _load_optimizer(optimizer, state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    loader.load_state_dict(state["loader"])
    if same_layout:
        rng = state["rng_state"]
        torch.set_rng_state(rng["cpu"])
        if rng["cuda"] is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng["cuda"])
        get_cuda_rng_tracker().set_states(rng["tracker"])
    return state["iteration"]
