"""Distributed checkpoints (megatron.core.dist_checkpointing) of a training run.

Layout of ``checkpoint.dir``::

    iter_0000100/        a sharded checkpoint: model, optimizer, scheduler, loader, RNG
    iter_0000100/run_config.yaml   the resolved training config (rebuilds the model)
    latest               "iter_0000100", written only after a complete save

A checkpoint saved at one TP/PP layout loads at another (the model and optimizer are
sharded tensors); the RNG states are restored only at the layout they were saved at.
Checkpoints written before a parameter was renamed load too (``load_sharded``).
"""

import os
import re
from pathlib import Path
from typing import List, Optional

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing, parallel_state
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import ShardedBase, ShardedObject
from megatron.core.dist_checkpointing.serialization import load_sharded_metadata
from megatron.core.tensor_parallel import get_cuda_rng_tracker

LATEST = "latest"
RUN_CONFIG = "run_config.yaml"

# Sharded keys renamed since checkpoints were written: (new spelling, old spelling), in order.
# Optimizer states are keyed by their parameter's key, so they follow.
RENAMED_KEYS = (
    (re.compile(r"\bin_proj\."), "linear_in."),  # MultiMixer's fused projections
    (re.compile(r"\bout_proj\."), "linear_out."),
    (re.compile(r"\blinear_mixer\."), ""),  # A_log, dt_bias, D: were MultiMixer's own
)


def iteration_dir(ckpt_dir: str, iteration: int) -> Path:
    return Path(ckpt_dir) / f"iter_{iteration:07d}"


def latest_checkpoint(ckpt_dir: Optional[str]) -> Optional[Path]:
    """The checkpoint `latest` points to, or None when there is none yet."""
    if not ckpt_dir or not (Path(ckpt_dir) / LATEST).exists():
        return None
    path = Path(ckpt_dir) / (Path(ckpt_dir) / LATEST).read_text().strip()
    if not path.is_dir():
        raise FileNotFoundError(f"{Path(ckpt_dir) / LATEST} points to {path}, which does not exist")
    return path


def old_key(key: str) -> str:
    """The spelling of a sharded key before the renames of RENAMED_KEYS."""
    for new, old in RENAMED_KEYS:
        key = new.sub(old, key)
    return key


def load_sharded(sharded_state: dict, path: Path) -> dict:
    """``dist_checkpointing.load``, also of a checkpoint written before a key was renamed: an
    entry the checkpoint lacks is read from its old spelling. The loaded state keeps the
    current names (it is keyed like ``sharded_state``)."""
    saved = {entry.key for entry in load_sharded_metadata(str(path)).values()}
    for entry in nested_values(sharded_state):
        if isinstance(entry, ShardedBase) and entry.key not in saved and old_key(entry.key) in saved:
            entry.key = old_key(entry.key)
    return dist_checkpointing.load(sharded_state, str(path))


def _layout() -> List[int]:
    return [
        parallel_state.get_pipeline_model_parallel_world_size(),
        parallel_state.get_tensor_model_parallel_world_size(),
        parallel_state.get_data_parallel_world_size(),
    ]


def _rng_state() -> ShardedObject:
    """This rank's RNG states, one shard per (pp, tp, dp) coordinate."""
    state = {
        "cpu": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
        "tracker": get_cuda_rng_tracker().get_states(),
    }
    coordinates = [
        parallel_state.get_pipeline_model_parallel_rank(),
        parallel_state.get_tensor_model_parallel_rank(),
        parallel_state.get_data_parallel_rank(),
    ]
    return ShardedObject("rng_state", state, tuple(_layout()), tuple(coordinates), replica_id=0)


def _sharded_state(model_chunks, optimizer, is_loading: bool, with_rng: bool) -> dict:
    state = {}  # keys of the unwrapped model (no DDP "module." prefix): a bare model loads them
    for i, chunk in enumerate(model_chunks):
        state["model" if len(model_chunks) == 1 else f"model{i}"] = chunk.module.sharded_state_dict()
    model_state = {k: v for k, v in state.items() if k.startswith("model")}
    state["optimizer"] = optimizer.sharded_state_dict(model_state, is_loading=is_loading)
    if with_rng:
        state["rng_state"] = _rng_state()
    return state


def save_checkpoint(ckpt_dir: str, iteration: int, model_chunks, optimizer, scheduler, loader,
                    run_config_yaml: str) -> Path:
    """Save on every rank; `latest` moves only once every rank has finished writing."""
    path = iteration_dir(ckpt_dir, iteration)
    if dist.get_rank() == 0:
        path.mkdir(parents=True, exist_ok=True)
        (path / RUN_CONFIG).write_text(run_config_yaml)
    dist.barrier()
    state = _sharded_state(model_chunks, optimizer, is_loading=False, with_rng=True)
    state.update(
        iteration=iteration,
        scheduler=scheduler.state_dict(),
        loader=loader.state_dict(),
        layout=_layout(),
    )
    dist_checkpointing.save(state, str(path))
    dist.barrier()
    if dist.get_rank() == 0:
        tmp = Path(ckpt_dir) / f"{LATEST}.tmp"
        tmp.write_text(path.name + "\n")
        os.replace(tmp, Path(ckpt_dir) / LATEST)
    dist.barrier()
    return path


def load_checkpoint(path: Path, model_chunks, optimizer, scheduler, loader) -> int:
    """Restore everything saved at `path`; returns the iteration to continue from."""
    common = dist_checkpointing.load_common_state_dict(str(path))
    same_layout = common["layout"] == _layout()
    state = load_sharded(_sharded_state(model_chunks, optimizer, is_loading=True, with_rng=same_layout), path)
    for i, chunk in enumerate(model_chunks):
        chunk.module.load_state_dict(state["model" if len(model_chunks) == 1 else f"model{i}"])
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    loader.load_state_dict(state["loader"])
    if same_layout:
        rng = state["rng_state"]
        torch.set_rng_state(rng["cpu"])
        if rng["cuda"] is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng["cuda"])
        get_cuda_rng_tracker().set_states(rng["tracker"])
    return state["iteration"]
