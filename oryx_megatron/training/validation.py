"""Everything about a run that can be checked before any process group, model or folder exists.

``validate_run(run)`` raises ``ConfigError`` naming the key, file or value of the first problem:
the data paths (blend syntax, manifests readable, shard files present, tokens > 0, one
tokenizer across a blend, an EOD id for ``data.reset_at_eod``; Megatron ``.bin``/``.idx`` pairs
for ``data.format=indexed``), the data's tokenizer vocab against ``model.vocab_size``, the
held-out split (the shard count against ``data.holdout_shards``; a one-document source against
``data.seq_length``) and the batch sizes against the data-parallel size of the launch
(``WORLD_SIZE``). It logs one line saying what is held out. ``oryx-train`` calls it first and
prints the error as one line (``cli.errors``; ``--debug``: the traceback). Only reads files; never
imports the loaders' workers.
"""

import logging
import os
from pathlib import Path

from oryx_megatron.data.loader import parse_blend
from oryx_megatron.data.shards import Manifest
from oryx_megatron.launch import distributed_env_from_slurm
from oryx_megatron.run_config import ConfigError, TrainConfig

logger = logging.getLogger(__name__)

RECOMPUTE_GRANULARITIES = (None, "selective", "full")


def validate_run(run: TrainConfig, world_size: int = None) -> None:
    """Raise ConfigError on the first thing that would fail after the model is built."""
    _check_batches(run, _launch_world_size() if world_size is None else world_size)
    if run.train.recompute_granularity not in RECOMPUTE_GRANULARITIES:
        raise ConfigError(f"config key 'train.recompute_granularity': {run.train.recompute_granularity!r} is not "
                          f"one of {RECOMPUTE_GRANULARITIES}")
    if run.data.format == "shards":
        _check_shards(run)
    elif run.data.format == "indexed":
        _check_indexed(run)
    if run.router.mode == "posthoc" and not run.checkpoint.dir:
        raise ConfigError("config key 'checkpoint.dir': router.mode=posthoc saves the model with its router there")


def _launch_world_size() -> int:
    """The processes of this launch: torchrun's WORLD_SIZE, else the one an srun step will get
    (``launch.distributed_env_from_slurm``), else 1."""
    if "WORLD_SIZE" in os.environ:
        return int(os.environ["WORLD_SIZE"])
    return int(distributed_env_from_slurm().get("WORLD_SIZE", 1))


def _check_batches(run: TrainConfig, world_size: int) -> None:
    t, p = run.train, run.parallel
    model_parallel = p.tensor_model_parallel_size * p.pipeline_model_parallel_size * p.context_parallel_size
    if world_size % model_parallel:
        raise ConfigError(
            f"config keys 'parallel.*': {world_size} processes are not a multiple of tensor x pipeline x context "
            f"parallel size {p.tensor_model_parallel_size} x {p.pipeline_model_parallel_size} x "
            f"{p.context_parallel_size}"
        )
    dp = world_size // model_parallel
    if t.global_batch_size % (t.micro_batch_size * dp):
        raise ConfigError(
            f"config key 'train.global_batch_size': {t.global_batch_size} is not a multiple of "
            f"train.micro_batch_size={t.micro_batch_size} x data-parallel size {dp}"
        )


def _paths(run: TrainConfig):
    try:
        return parse_blend(list(run.data.data_path))[0]
    except ValueError as e:
        raise ConfigError(f"config key 'data.data_path': {e}") from None


def _check_shards(run: TrainConfig) -> None:
    d = run.data
    first, held_out = None, []
    for path in _paths(run):
        try:
            manifest = Manifest.read(path)
        except (OSError, ValueError) as e:
            raise ConfigError(f"config key 'data.data_path': {e}") from None
        missing = [s.path for s in manifest.shards if not manifest.shard_path(s).is_file()]
        if missing:
            raise ConfigError(
                f"config key 'data.data_path': {path}: shard file {manifest.root / missing[0]} is missing"
                f" ({len(missing)} of {len(manifest.shards)} shards)"
            )
        if manifest.tokens == 0:
            raise ConfigError(f"config key 'data.data_path': {path} holds no tokens")
        if manifest.tokens + manifest.documents - 1 < d.seq_length:  # an EOD after each document
            raise ConfigError(f"config key 'data.seq_length': {path} holds {manifest.tokens} tokens in "
                              f"{manifest.documents} document(s), no sample of {d.seq_length} + 1 tokens")
        if d.reset_at_eod and not (isinstance(manifest.eod_id, int) and 0 <= manifest.eod_id < manifest.vocab_size):
            raise ConfigError(f"config key 'data.reset_at_eod': {path} has no EOD id in [0, {manifest.vocab_size}) "
                              f"(manifest eod_id: {manifest.eod_id!r})")
        if d.holdout_shards and len(manifest.shards) > 1 and not 1 <= d.holdout_shards < len(manifest.shards):
            raise ConfigError(  # a single shard holds out documents instead (docs/data.md)
                f"config key 'data.holdout_shards': {d.holdout_shards} must be between 1 and "
                f"{len(manifest.shards) - 1} ({path} has {len(manifest.shards)} shards, one at least for training)"
            )
        if manifest.vocab_size > run.model.vocab_size:
            raise ConfigError(
                f"config key 'model.vocab_size': {run.model.vocab_size} is smaller than the data's tokenizer "
                f"vocab {manifest.vocab_size} ({path})"
            )
        key = (manifest.tokenizer.get("sha256"), manifest.eod_id, manifest.vocab_size)
        if first is None:
            first = (path, key)
        elif key != first[1]:
            raise ConfigError(
                f"config key 'data.data_path': {path} was tokenized with another tokenizer than {first[0]};"
                " blended sources must share one"
            )
        held_out.append(f"{path}: {_held_out(run, manifest)}")
    logger.info("held-out data: %s", "; ".join(held_out))


def _held_out(run: TrainConfig, manifest: Manifest) -> str:
    """What the training loader holds out of one source (``Manifest.holdout`` as ``build_loader``
    asks for it), in words; a one-document source too short to hold out a tail is a ConfigError."""
    d = run.data
    if not d.holdout_shards:
        return "nothing (data.holdout_shards=0)"
    try:
        train = manifest.holdout(d.holdout_shards, "train", min_tokens=d.seq_length,
                                 tail=run.train.eval_interval is not None)
    except ValueError as e:
        raise ConfigError(f"config key 'train.eval_interval': {e} (data.seq_length={d.seq_length}); "
                          f"train.eval_interval=null trains on all of it") from None
    if manifest.documents == 1:
        if train.stop is None:
            return f"nothing (one document; train.eval_interval=null): all {manifest.tokens:,} tokens train"
        return (f"the last {manifest.tokens - train.stop:,} of the {manifest.tokens:,} tokens of its one document "
                f"(too few documents to hold out)")
    if len(manifest.shards) > 1:
        return (f"the last {d.holdout_shards} of {len(manifest.shards)} shards "
                f"({manifest.documents - train.end} documents)")
    return f"the last {manifest.documents - train.end} of the {manifest.documents} documents of its one shard"


def _check_indexed(run: TrainConfig) -> None:
    for path in _paths(run):
        for suffix in (".bin", ".idx"):
            if not Path(path + suffix).is_file():
                raise ConfigError(f"config key 'data.data_path': {path + suffix}: no such file")
    if run.data.eod_id is not None and not 0 <= run.data.eod_id < run.model.vocab_size:
        raise ConfigError(
            f"config key 'data.eod_id': {run.data.eod_id} is outside [0, model.vocab_size={run.model.vocab_size})"
        )
