"""One run of an experiment: its oryx-train config and key, trained or reused; the width that matches a
reference's parameter count, and the learning rate a sweep chooses."""

import dataclasses
import hashlib
import json
import logging
from pathlib import Path
from typing import Any, Dict, List

import numpy as np
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from oryx_megatron import RECIPES_DIR
from oryx_megatron.checkpoint import latest_checkpoint, load_common
from oryx_megatron.config import FAMILY_MIXERS
from oryx_megatron.config.router import ALIASES as ROUTER_ALIASES
from oryx_megatron.experiments.config import Experiment
from oryx_megatron.inference.checkpoint import load_model
from oryx_megatron.models.match_width import matched_ffn
from oryx_megatron.run_config import TrainConfig, load_train_config, train_iters
from oryx_megatron.source import git_source, source_label

logger = logging.getLogger("oryx_megatron.experiment")

MIN_LR_RATIO = 0.1  # a swept run's optimizer.min_lr is this times its lr


def overrides(tree: Dict[str, Any], prefix: str = "") -> List[str]:
    """A nested oryx-train config as Hydra overrides: {data: {seq_length: 64}} -> data.seq_length=64."""
    out = []
    for key, value in tree.items():
        if isinstance(value, dict):
            out += overrides(value, f"{prefix}{key}.")
        else:
            out.append(f"{prefix}{key}={json.dumps(value)}")  # JSON is Hydra's syntax for scalars and lists
    return out


def run_overrides(exp: Experiment) -> List[str]:
    """The oryx-train overrides every run of ``exp`` shares: group choices, then fields."""
    return [f"{group}={choice}" for group, choice in exp.groups.items()] + overrides(exp.train)


def compose_run(model: str, seed: int, config: List[str]) -> TrainConfig:
    """The oryx-train config of one run (checkpoint.dir is set by the caller)."""
    with initialize_config_dir(str(RECIPES_DIR), version_base=None):
        cfg = compose("train", overrides=[f"model={model}", f"train.seed={seed}", "checkpoint.dir=null", *config])
    return load_train_config(cfg)


# Fields that do not shape the trained weights: runs differing only there are the same run.
NOT_IN_RUN_KEY = {"train": ("log_interval", "eval_interval", "eval_iters", "eval_schedules", "exit_interval")}
# fields added after runs were keyed: left out at their default, so that the earlier runs keep their keys
ADDED_WITH_DEFAULT = {"data": {"reset_at_eod": False, "mqar_query_spans": None, "mqar_context_segments": None},
                      "parallel": {"context_parallel_size": 1}, "router": {"estimator": "straight_through"},
                      "model": {"router_hidden": None, "router_chunk_size": 128, "router_layers": 1, "mixer_conv_activation": "silu",
                                "attention_rotary": True, "rotary_base": 10000.0, "A_init_range": [1.0, 16.0],
                                "dt_min": 0.001, "dt_max": 0.1, "dt_init_floor": 1e-4, "layer_pattern": None}}


def run_key(run: TrainConfig) -> str:
    """A hash of the model, data, optimizer, parallel and training settings that shape the
    trained weights (not where or how often they are logged, evaluated or saved)."""
    identity = OmegaConf.to_container(OmegaConf.structured(run))
    for section in ("checkpoint", "logging"):
        identity.pop(section)
    for section, keys in NOT_IN_RUN_KEY.items():
        for key in keys:
            identity[section].pop(key)
    for key, alias in ROUTER_ALIASES.items():  # keyed as the model's fields they were before the router's schema
        identity["model"][alias] = identity["router"].pop(key)
    if identity["router"]["mode"] == "none":  # added later too: the whole section when no router trains
        identity.pop("router")
    if identity["model"]["mixers"] == FAMILY_MIXERS[identity["model"]["family"]]:  # a family's own: not a field then
        identity["model"].pop("mixers")
    for section, defaults in ADDED_WITH_DEFAULT.items():
        for key, default in defaults.items():
            if section in identity and identity[section][key] == default:
                identity[section].pop(key)
    return hashlib.sha1(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:8]


def train_or_reuse(run: TrainConfig, run_dir: Path) -> Path:
    """Train ``run`` into ``run_dir`` unless a checkpoint at its last iteration is there;
    an unfinished run resumes from its latest checkpoint. Returns the checkpoint."""
    from oryx_megatron.training.loop import pretrain  # imports megatron's training stack

    ckpt_dir = run_dir / "checkpoints"
    latest = latest_checkpoint(str(ckpt_dir))
    if latest is not None and latest.name == f"iter_{train_iters(run):07d}":
        by, here = trained_by(latest), source_label(git_source())
        if by == here:
            logger.info("reusing %s", latest)
        else:  # runs are keyed by their config, not by the code that trained them
            logger.warning("reusing %s, trained by the code at %s (this checkout: %s); remove %s to train it again",
                           latest, by, here, run_dir)
        return latest
    run = dataclasses.replace(run, checkpoint=dataclasses.replace(run.checkpoint, dir=str(ckpt_dir), save_at_end=True))
    exit_code = pretrain(run, str(run_dir))
    if exit_code:
        raise RuntimeError(f"training {run_dir} stopped early (exit code {exit_code}); rerun the experiment to resume")
    return latest_checkpoint(str(ckpt_dir))


def trained_by(checkpoint: Path) -> str:
    """The code that trained ``checkpoint`` (its last save), in a word: ``source_label`` of its common state's
    ``source``; "unknown" for a checkpoint written before sources were recorded."""
    return source_label(load_common(checkpoint).get("source"))


def train_and_load(model: str, seed: int, config: List[str], out: Path):
    """(the trained model, its run config, its run name): trained unless an equal run exists."""
    run = compose_run(model, seed, config)
    name = f"{model}-s{seed}-{run_key(run)}"  # no variant: equal configs share one run
    checkpoint = train_or_reuse(run, out / "runs" / name)
    net, run = load_model(str(checkpoint))
    return net, run, name


def width_overrides(exp: Experiment, config: List[str]) -> Dict[str, List[str]]:
    """Per model, the override that matches its parameter count to ``match_params``' ([] for
    that model, and for every model when unset)."""
    if exp.match_params is None:
        return {model: [] for model in exp.models}
    shape = {model: compose_run(model, exp.seeds[0], config).model for model in exp.models}
    return {model: [] if model == exp.match_params else
            [f"model.ffn_hidden_size={matched_ffn(shape[exp.match_params], shape[model])}"] for model in exp.models}


def lr_overrides(lr: float) -> List[str]:
    return [f"optimizer.lr={lr}", f"optimizer.min_lr={lr * MIN_LR_RATIO:.6g}"]


def choose_lr(validation_losses: Dict[float, List[float]]) -> float:
    """The learning rate of the lowest mean validation loss over seeds (a non-finite loss
    loses); ties go to the smaller learning rate. Validation losses are all it sees."""
    if not validation_losses:
        raise ValueError("choose_lr: no learning rates to choose from")

    def mean(lr: float) -> float:
        value = float(np.mean(validation_losses[lr]))
        return value if np.isfinite(value) else float("inf")

    return min(sorted(validation_losses), key=mean)
