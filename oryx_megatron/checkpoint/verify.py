"""Every checkpoint is verified before megatron reads it (``verify_checkpoint``): each file is present, ``.metadata``
places everything it lists in a shard, no shard is shorter than it says, every pickle in it loads with restricted
unpicklers (``.metadata``: only torch.distributed.checkpoint's metadata classes; the common state (``common.pt``, or
from megatron-core 0.19 the ``common_state`` object in the shards: ``oryx_megatron.compat.megatron``) and the byte
objects inside the shards: ``torch.load(weights_only=True)``), so the unrestricted ``pickle.load`` /
``torch.load(weights_only=False)`` that megatron and torch.distributed.checkpoint then run over the same bytes execute
no code; and every file still has the bytes its save wrote (``checksums.verify_checksums``; not in checkpoints written
before checksums). A damaged checkpoint raises one ``CheckpointError`` naming the file; resuming skips it for the
newest good one (``latest_checkpoint``). A save runs the same checks before it publishes a checkpoint."""

import importlib
import io
import json
import logging
import pickle
from pathlib import Path
from typing import Optional

import torch
from omegaconf import DictConfig

from oryx_megatron.checkpoint.checksums import verify_checksums
from oryx_megatron.checkpoint.files import (
    CONFIG,
    METADATA,
    RUN_CONFIG,
    KNOWN_FORMAT_VERSIONS,
    CheckpointError,
    CheckpointVersionError,
    checkpoints,
    iteration_of,
    latest_name,
)
from oryx_megatron.compat.megatron import (
    COMMON_FILE,
    COMMON_OBJECT,
    common_state_location,
)

logger = logging.getLogger("oryx_megatron.train")


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


def verify_checkpoint(path: Path, checksums: bool = True) -> None:
    """Raise CheckpointError (naming the file) unless every file of the checkpoint at ``path`` is present and
    readable: metadata.json, run_config.yaml, .metadata (restricted unpickler), which places every tensor chunk
    and byte object it lists in a shard file, every ``__N_M.distcp`` shard it names at least as long as the byte
    ranges it lists, the common state (``load_common``: weights_only) and every byte object in the shards
    (weights_only); then, with ``checksums``, that every file matches its checksum (``ChecksumMismatch``: a shard
    of the right length with flipped bits). A checkpoint written before checksums has none to match;
    ``checksums=False`` (reading every byte of the checkpoint again) is for a load of one that was verified whole
    already, and for a save, whose writers hashed the bytes as they wrote them."""
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
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

    for key, item in items.items():  # where each tensor chunk and byte object lies: a shard file of storage_data
        chunks = [None] if isinstance(item, BytesStorageMetadata) else [c.offsets for c in item.chunks]
        if any(MetadataIndex(key, offsets) not in storage for offsets in chunks):
            raise CheckpointError(path, f"{METADATA} lists {key} in no shard file")
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
                raise CheckpointError(
                    path, f"{info.relative_path}: object {index.fqn} is unreadable ({detail[:200]})") from None
    if checksums:
        verify_checksums(path)


def _load_yaml(file: Path):
    """The run config, typed against the schema (yaml.SafeLoader underneath: no code runs). A
    file cut short within its first sections fails here; one cut in its last sections may not."""
    from omegaconf import OmegaConf

    from oryx_megatron.run_config import TrainConfig

    loaded = OmegaConf.load(file)
    if not isinstance(loaded, DictConfig) or "model" not in loaded:
        raise ValueError("no model section")
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(TrainConfig), loaded))


def load_common(path: Path, metadata=None) -> dict:
    """The non-sharded state of the checkpoint at ``path`` (iteration, scheduler, loader, layout, run
    id, optimizer param groups), loaded with weights_only from where its megatron-core version put it
    (``common.pt`` or the shards' ``common_state`` object: ``compat.megatron``). ``metadata``: its
    ``.metadata`` when already read (else read here, restricted unpickler). CheckpointError naming the
    file when the state is missing, unreadable or holds no training state; CheckpointVersionError when its
    ``format_version`` is not one this code knows (none: a checkpoint of layout 1, written before it was recorded)."""
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
    if common.get("format_version", 1) not in KNOWN_FORMAT_VERSIONS:
        raise CheckpointVersionError(path, common["format_version"])
    return common


