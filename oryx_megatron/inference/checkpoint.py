"""Load a training checkpoint (any TP/PP layout) into one process for inference and eval."""

from pathlib import Path
from typing import Tuple

import torch
from omegaconf import DictConfig, OmegaConf

from oryx_megatron.checkpoint import (
    CONFIG,
    LATEST,
    RUN_CONFIG,
    latest_checkpoint,
    load_sharded,
    verify_checkpoint,
)
from oryx_megatron.config import ModelArgs
from oryx_megatron.config.router import move_aliases
from oryx_megatron.models.builder import build_model, transformer_config
from oryx_megatron.parallel import initialize_parallel
from oryx_megatron.run_config import TrainConfig


def resolve_checkpoint(path: str) -> Path:
    """A checkpoint directory (iter_NNNNNNN), or a run's checkpoint.dir (then the one its `latest`
    names), verified: a damaged checkpoint raises CheckpointError (a FileNotFoundError) naming
    the file. No fallback to an older checkpoint: evaluating another one than asked is an error."""
    path = Path(path)
    is_checkpoint = any((path / name).exists() for name in (RUN_CONFIG, CONFIG))
    if is_checkpoint or (path.name.startswith("iter_") and not (path / LATEST).exists()):
        verify_checkpoint(path)
        return path
    latest = latest_checkpoint(str(path), fallback=False)
    if latest is None:
        raise FileNotFoundError(f"{path} is neither a checkpoint (no {RUN_CONFIG}) nor a checkpoint dir with 'latest'")
    return latest


def migrate_run_config(cfg: DictConfig) -> DictConfig:
    """A run config written before ``train.recompute_activations`` (full recomputation) became
    ``train.recompute_granularity``, or before the router had its schema (``model.router_hidden``, ... became
    ``router.hidden``, ...), in today's keys."""
    train = cfg.get("train") or {}
    if "recompute_activations" in train:
        train.recompute_granularity = "full" if train.pop("recompute_activations") else None
    return move_aliases(cfg)


def load_model(path: str, dtype: torch.dtype = torch.float32,
               context_parallel_size: int = 1) -> Tuple[torch.nn.Module, TrainConfig]:
    """The model of a checkpoint at TP = PP = 1 in eval mode, and the run's config. ``context_parallel_size``
    (a launch of that many processes): every sequence of a forward split over them, for contexts one process
    does not hold (``eval.ppl``); decoding with caches runs in one process."""
    ckpt = resolve_checkpoint(path)
    schema = OmegaConf.structured(TrainConfig)
    run: TrainConfig = OmegaConf.to_object(OmegaConf.merge(schema, migrate_run_config(OmegaConf.load(ckpt / RUN_CONFIG))))
    initialize_parallel(seed=run.train.seed, context_parallel_size=context_parallel_size)
    args: ModelArgs = run.model
    model = build_model(args, transformer_config(args, run.router, params_dtype=dtype, perform_initialization=False,
                                                 context_parallel_size=context_parallel_size))
    state = load_sharded({"model": model.sharded_state_dict()}, ckpt)
    model.load_state_dict(state["model"])
    return model.eval(), run  # built in dtype (the SSM scalars in fp32): no cast
