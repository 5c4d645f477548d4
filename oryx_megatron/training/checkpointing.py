"""Distributed checkpoints (megatron.core.dist_checkpointing) of a training run.

Layout of ``checkpoint.dir``::

    iter_0000100/        a sharded checkpoint: model, optimizer, scheduler, loader, RNG
    iter_0000100/run_config.yaml   the resolved training config (rebuilds the model)
    latest               "iter_0000100", written only after a complete save

A checkpoint saved at one TP/PP layout loads at another (the model and optimizer are
sharded tensors; the distributed optimizer's state in megatron's ``fully_reshardable`` format,
``OPTIMIZER_FORMAT``); the RNG states are restored only at the layout they were saved at.
Checkpoints written before a parameter was renamed load too (``load_sharded``).

Every checkpoint is verified before megatron reads it (``verify_checkpoint``): each file is
present, no shard is shorter than ``.metadata`` says, and every pickle in it loads with
restricted unpicklers (``.metadata``: only torch.distributed.checkpoint's metadata classes;
the common state (``common.pt``, or from megatron-core 0.19 the ``common_state`` object in the
shards: ``oryx_megatron.compat.megatron``) and the byte objects inside the shards:
``torch.load(weights_only=True)``), so the unrestricted ``pickle.load`` /
``torch.load(weights_only=False)`` that megatron and torch.distributed.checkpoint then run over
the same bytes execute no code. A damaged checkpoint raises one ``CheckpointError`` naming the
file; resuming skips it for the newest good one (``latest_checkpoint``).
"""

import importlib
import io
import json
import logging
import os
import pickle
import re
import shutil
from pathlib import Path
from typing import List, Optional, Set

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing, parallel_state
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import ShardedBase, ShardedObject
from megatron.core.dist_checkpointing.serialization import load_sharded_metadata
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
from megatron.core.tensor_parallel import get_cuda_rng_tracker
from omegaconf import DictConfig

from oryx_megatron.compat.megatron import COMMON_FILE, COMMON_OBJECT, common_state_location

logger = logging.getLogger("oryx_megatron.train")

LATEST = "latest"
RUN_CONFIG = "run_config.yaml"
METADATA = ".metadata"  # torch.distributed.checkpoint's pickled Metadata: which bytes of which shard hold what
CONFIG = "metadata.json"  # megatron's format marker, written last by dist_checkpointing.save
OPTIMIZER_FORMAT = "fully_reshardable"  # the distributed optimizer's: loads at any layout (docs/training.md)
OPTIMIZER_METADATA = {"distrib_optim_sharding_type": OPTIMIZER_FORMAT}
_ITER_DIR = re.compile(r"^iter_(\d{7,})$")

# Sharded keys renamed since checkpoints were written: (new spelling, old spelling), in order.
# Optimizer states are keyed by their parameter's key, so they follow.
RENAMED_KEYS = (
    (re.compile(r"\bin_proj\."), "linear_in."),  # MultiMixer's fused projections
    (re.compile(r"\bout_proj\."), "linear_out."),
    (re.compile(r"\blinear_mixer\."), ""),  # A_log, dt_bias, D: were MultiMixer's own
    (re.compile(r"\b(conv_[a-z_]+)\.weight\b"), r"\1"),  # the short convs and output norm: were MultiMixer's
    (re.compile(r"\bout_norm\.weight\b"), "out_norm_weight"),  # own parameters (before the one mixer core)
)


def iteration_dir(ckpt_dir: str, iteration: int) -> Path:
    return Path(ckpt_dir) / f"iter_{iteration:07d}"


class CheckpointError(FileNotFoundError):
    """A checkpoint that cannot be loaded; the message names the checkpoint and the file. A
    FileNotFoundError (the checkpoint, as a whole, is not there) so that the tools' checkpoint
    argument check reports it in one line."""

    def __init__(self, path, reason: str):
        super().__init__(f"{path} is damaged: {reason}")
        self.path, self.reason = Path(path), reason


def iteration_of(path: Path) -> Optional[int]:
    match = _ITER_DIR.match(Path(path).name)
    return int(match.group(1)) if match else None


def checkpoints(ckpt_dir: str) -> List[Path]:
    """The iter_NNNNNNN directories of ckpt_dir, oldest first (complete or not)."""
    if not ckpt_dir or not Path(ckpt_dir).is_dir():
        return []
    found = [p for p in Path(ckpt_dir).iterdir() if p.is_dir() and iteration_of(p) is not None]
    return sorted(found, key=iteration_of)


def latest_name(ckpt_dir: Optional[str]) -> Optional[Path]:
    """The checkpoint `latest` names (unverified; it may be missing), or None without `latest`."""
    if not ckpt_dir or not (Path(ckpt_dir) / LATEST).exists():
        return None
    return Path(ckpt_dir) / (Path(ckpt_dir) / LATEST).read_text().strip()


def latest_checkpoint(ckpt_dir: Optional[str], fallback: bool = True) -> Optional[Path]:
    """The checkpoint to resume from: the one `latest` names, verified; when it is damaged
    (``fallback``) the newest older checkpoint that verifies, logging each one skipped and why.
    None when there is no `latest` yet; CheckpointError when no candidate is intact (or,
    without ``fallback``, when the one `latest` names is damaged)."""
    named = latest_name(ckpt_dir)
    if named is None:
        return None
    candidates = [named]
    if fallback and iteration_of(named) is not None:
        candidates += [p for p in reversed(checkpoints(ckpt_dir)) if iteration_of(p) < iteration_of(named)]
    first_error = None
    for path in candidates:
        try:
            verify_checkpoint(path)
            return path
        except CheckpointError as e:
            if not fallback:
                raise
            first_error = first_error or e
            logger.warning("skipping damaged checkpoint %s: %s", path, e.reason)
    raise CheckpointError(first_error.path, f"{first_error.reason}; no older checkpoint in {ckpt_dir} is intact")


# The globals a torch.distributed.checkpoint ``.metadata`` pickle may name (torch 2.x).
_METADATA_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.planner")
_METADATA_GLOBALS = {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
    ("torch.serialization", "_get_layout"), ("collections", "OrderedDict"),
    ("builtins", "set"), ("builtins", "frozenset"), ("builtins", "slice"),
}


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles a ``.metadata`` file, refusing any global but the metadata classes and dtypes."""

    def find_class(self, module, name):
        if "." not in name:  # no dotted paths through a module's imports
            if (module, name) in _METADATA_GLOBALS:
                return super().find_class(module, name)
            if module in _METADATA_MODULES:  # a class (dataclass, enum) defined there, nothing it imported
                found = getattr(importlib.import_module(module), name, None)
                if isinstance(found, type) and found.__module__ == module:
                    return found
            if module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.memory_format)):
                return getattr(torch, name)
        raise pickle.UnpicklingError(f"refuses to load global {module}.{name}")


def _read(path: Path, name: str, parse):
    try:
        return parse(path / name)
    except FileNotFoundError:
        raise CheckpointError(path, f"{name} is missing") from None
    except CheckpointError:
        raise
    except Exception as e:  # truncated, garbled or unsafe: one message naming the file
        size = (path / name).stat().st_size if (path / name).exists() else 0
        raise CheckpointError(path, f"{name} is truncated or unreadable ({size} bytes: {_detail(e)})") from None


def _detail(e: Exception) -> str:
    """The first sentence of an error's message (at most 160 characters), or its type's name."""
    return (str(e).strip().splitlines()[0].split(". ")[0] if str(e).strip() else type(e).__name__)[:160]


def _load_metadata(file: Path):
    with open(file, "rb") as f:
        return _MetadataUnpickler(f).load()


def verify_checkpoint(path: Path) -> None:
    """Raise CheckpointError (naming the file) unless every file of the checkpoint at ``path``
    is present and readable: metadata.json, run_config.yaml, .metadata (restricted unpickler),
    every ``__N_M.distcp`` shard it names at least as long as the byte ranges it lists, the
    common state (``load_common``: weights_only) and every byte object in the shards
    (weights_only). Contents are not checksummed (the format has no checksums): a shard of the
    right length with flipped bits is not detected."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(path, "the directory does not exist")
    config = _read(path, CONFIG, lambda f: json.loads(f.read_text()))
    if not isinstance(config, dict) or config.get("sharded_backend") != "torch_dist":
        raise CheckpointError(path, f"{CONFIG} is not a torch_dist checkpoint's ({config!r})")
    _read(path, RUN_CONFIG, _load_yaml)
    metadata = _read(path, METADATA, _load_metadata)
    try:
        storage = dict(metadata.storage_data)
        items = metadata.state_dict_metadata
    except (AttributeError, TypeError):
        raise CheckpointError(path, f"{METADATA} is not a checkpoint metadata") from None
    needed = {}
    for info in storage.values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name in sorted(needed):
        file = path / name
        if not file.is_file():
            raise CheckpointError(path, f"{name} is missing (named by {METADATA})")
        size = file.stat().st_size
        if size < needed[name]:
            raise CheckpointError(path, f"{name} is truncated ({size} bytes, {METADATA} needs {needed[name]})")
    load_common(path, metadata)
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    byte_keys = {key for key, item in items.items() if isinstance(item, BytesStorageMetadata)}
    for index, info in storage.items():
        if index.fqn in byte_keys:
            with open(path / info.relative_path, "rb") as f:
                f.seek(info.offset)
                data = f.read(info.length)
            try:
                torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
            except Exception as e:
                detail = (str(e).strip().splitlines() or [type(e).__name__])[0]
                raise CheckpointError(path, f"{info.relative_path}: object {index.fqn} is unreadable ({detail[:200]})") \
                    from None


def _load_yaml(file: Path):
    """The run config, typed against the schema (yaml.SafeLoader underneath: no code runs). A
    file cut short within its first sections fails here; one cut in its last sections may not."""
    from omegaconf import OmegaConf

    from oryx_megatron.run_config import TrainConfig

    loaded = OmegaConf.load(file)
    if not isinstance(loaded, DictConfig) or "model" not in loaded:
        raise ValueError("no model section")
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(TrainConfig), loaded))


def apply_retention(ckpt_dir: str, keep_last: Optional[int], keep_every: Optional[int]) -> List[Path]:
    """Delete the checkpoints retention does not keep: it keeps the ``keep_last`` newest (None:
    all), every iteration divisible by ``keep_every``, and always the one `latest` names.
    Directories newer than `latest` (a save that did not finish) are left alone; the next save
    of that iteration replaces them. Returns the deleted directories."""
    if keep_last is None:
        return []
    named = latest_name(ckpt_dir)
    if named is None:
        return []
    newest = iteration_of(named)
    complete = [p for p in checkpoints(ckpt_dir) if newest is None or iteration_of(p) <= newest]
    keep: Set[Path] = set(complete[-keep_last:]) | {named}
    if keep_every:
        keep |= {p for p in complete if iteration_of(p) % keep_every == 0}
    deleted = []
    for path in complete:
        if path not in keep:
            shutil.rmtree(path, ignore_errors=True)
            deleted.append(path)
    if deleted:
        logger.info("retention (keep_last=%s, keep_every=%s): deleted %s", keep_last, keep_every,
                    ", ".join(p.name for p in deleted))
    return deleted


def check_retention(keep_last: Optional[int], keep_every: Optional[int]) -> None:
    from oryx_megatron.run_config import ConfigError

    for key, value in (("checkpoint.keep_last", keep_last), ("checkpoint.keep_every", keep_every)):
        if value is not None and value < 1:
            raise ConfigError(f"config key '{key}': {value} must be positive (or null)")


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


def save_checkpoint(ckpt_dir: str, iteration: int, model_chunks, optimizer, scheduler, loader,
                    run_config_yaml: str, keep_last: Optional[int] = None, keep_every: Optional[int] = None,
                    extra: Optional[dict] = None) -> Path:
    """Save on every rank; `latest` moves only once every rank has finished writing, then rank 0
    applies retention. The directory starts empty: a leftover of a save that did not finish (it
    is never the one `latest` names) is removed first. run_config.yaml is written after megatron's
    files and before `latest` moves; a crash in between leaves a directory that `latest` does not
    name, which verification rejects and the next save of that iteration replaces. ``extra``:
    more non-sharded state (e.g. the W&B run id), saved in the common state (``compat.megatron``)."""
    path = iteration_dir(ckpt_dir, iteration)
    if dist.get_rank() == 0:
        named = latest_name(ckpt_dir)
        if path.exists() and named is not None and path.resolve() == named.resolve():
            # a fresh run (checkpoint.load=false) in a used dir: `latest` must not name it while it is rewritten
            older = [p for p in checkpoints(ckpt_dir) if iteration_of(p) < iteration]
            logger.warning("overwriting %s; `latest` names %s until the save completes", path,
                           older[-1].name if older else "nothing")
            if older:
                _write_latest(ckpt_dir, older[-1].name)
            else:
                (Path(ckpt_dir) / LATEST).unlink()
        elif path.exists():
            logger.warning("removing %s: a save of iteration %d that did not finish", path, iteration)
        shutil.rmtree(path, ignore_errors=True)
        path.mkdir(parents=True)
    dist.barrier()
    state = _sharded_state(model_chunks, optimizer, is_loading=False, with_rng=True)
    state.update(
        iteration=iteration,
        scheduler=scheduler.state_dict(),
        loader=loader.state_dict(),
        layout=_layout(),
        **(extra or {}),
    )
    dist_checkpointing.save(state, str(path))
    dist.barrier()
    if dist.get_rank() == 0:
        (path / RUN_CONFIG).write_text(run_config_yaml)
        _write_latest(ckpt_dir, path.name)
        apply_retention(ckpt_dir, keep_last, keep_every)
    dist.barrier()
    return path


def _write_latest(ckpt_dir: str, name: str) -> None:
    tmp = Path(ckpt_dir) / f"{LATEST}.tmp"
    tmp.write_text(name + "\n")
    os.replace(tmp, Path(ckpt_dir) / LATEST)


def load_common(path: Path, metadata=None) -> dict:
    """The non-sharded state of the checkpoint at ``path`` (iteration, scheduler, loader, layout, run
    id, optimizer param groups), loaded with weights_only from where its megatron-core version put it
    (``common.pt`` or the shards' ``common_state`` object: ``compat.megatron``). ``metadata``: its
    ``.metadata`` when already read (else read here, restricted unpickler). CheckpointError naming the
    file when the state is missing, unreadable or holds no training state."""
    path = Path(path)
    if metadata is None:
        metadata = _read(path, METADATA, _load_metadata)
    where = common_state_location(path, metadata)
    if where is None:
        raise CheckpointError(path, f"{COMMON_FILE} is missing and {METADATA} names no {COMMON_OBJECT} object")
    try:
        common = where.load(path)
    except Exception as e:  # truncated, garbled or unsafe
        raise CheckpointError(path, f"{where.name} is truncated or unreadable ({where.length} bytes: {_detail(e)})") \
            from None
    if not isinstance(common, dict) or "iteration" not in common:
        raise CheckpointError(path, f"{where.name} holds no training state")
    return common


def load_checkpoint(path: Path, model_chunks, optimizer, scheduler, loader) -> int:
    """Restore everything saved at `path` (verified first); returns the iteration to continue from."""
    verify_checkpoint(path)
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
