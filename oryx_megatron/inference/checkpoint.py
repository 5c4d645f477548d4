"""Load a training checkpoint (any TP/PP layout) into one process for inference and eval."""

from pathlib import Path
from typing import Tuple

import torch
from omegaconf import OmegaConf

from oryx_megatron.models.builder import ModelArgs, build_model, transformer_config
from oryx_megatron.parallel import initialize_parallel
from oryx_megatron.training.checkpointing import RUN_CONFIG, latest_checkpoint, load_sharded
from oryx_megatron.training.config import TrainConfig


def resolve_checkpoint(path: str) -> Path:
    """A checkpoint directory (iter_NNNNNNN), or a run's checkpoint.dir (then its `latest`)."""
    path = Path(path)
    if (path / RUN_CONFIG).exists():
        return path
    latest = latest_checkpoint(str(path))
    if latest is None:
        raise FileNotFoundError(f"{path} is neither a checkpoint (no {RUN_CONFIG}) nor a checkpoint dir with 'latest'")
    return latest


def load_model(path: str, dtype: torch.dtype = torch.float32) -> Tuple[torch.nn.Module, TrainConfig]:
    """The model of a checkpoint at TP = PP = 1 in eval mode, and the run's config."""
    ckpt = resolve_checkpoint(path)
    schema = OmegaConf.structured(TrainConfig)
    run: TrainConfig = OmegaConf.to_object(OmegaConf.merge(schema, OmegaConf.load(ckpt / RUN_CONFIG)))
    initialize_parallel(seed=run.train.seed)
    args: ModelArgs = run.model
    model = build_model(args, transformer_config(args, params_dtype=dtype, perform_initialization=False))
    state = load_sharded({"model": model.sharded_state_dict()}, ckpt)
    model.load_state_dict(state["model"])
    return model.to(dtype).eval(), run
