"""The files of a distributed checkpoint (megatron.core.dist_checkpointing) and of a run's checkpoint directory.

Layout of ``checkpoint.dir``::

    iter_0000100/        a sharded checkpoint: model, optimizer, scheduler, loader, RNG
    iter_0000100/run_config.yaml   the resolved training config (rebuilds the model)
    latest               "iter_0000100", written only after a complete save

Training writes them (``oryx_megatron.training.checkpointing``); training, inference, evaluation and the Hugging
Face export read them through this package. Checkpoints written before a parameter was renamed load too
(``load_sharded``).
"""

import logging
import re
import shutil
from pathlib import Path
from typing import Iterable, List, Optional, Set

import torch.distributed as dist
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import ShardedBase
from megatron.core.dist_checkpointing.serialization import load_sharded_metadata

logger = logging.getLogger("oryx_megatron.train")

LATEST = "latest"
RUN_CONFIG = "run_config.yaml"
METADATA = ".metadata"  # torch.distributed.checkpoint's pickled Metadata: which bytes of which shard hold what
CONFIG = "metadata.json"  # megatron's format marker, written last by dist_checkpointing.save
_ITER_DIR = re.compile(r"^iter_(\d{7,})$")
_OPTIMIZER_STATE = re.compile(r"^optimizer\.state\.\w+\.")  # optimizer.state.<exp_avg, ...>.<parameter key>
_RUN_OBJECTS = ("rng_state", "common_state")  # sharded keys of the run's, not the model's (compat.megatron)
_KEYS_NAMED = 8  # the unknown keys a CheckpointKeysError names (then: "and N more")
# The layout of the checkpoints this code writes, in their common state as ``format_version``; raised by a change
# that this code's readers could not load. Checkpoints written before it was recorded have layout 1.
FORMAT_VERSION = 1
KNOWN_FORMAT_VERSIONS = (1,)

# Sharded keys renamed since checkpoints were written: (new spelling, old spelling), in order. THE migration
# table: a checkpoint key that the model has under neither spelling refuses to load (CheckpointKeysError).
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


class CheckpointKeysError(ValueError):
    """A checkpoint holding keys that the model loading it does not have (a module of another design),
    and that no migration of RENAMED_KEYS maps to one it has; the message names them."""

    def __init__(self, path, keys: List[str]):
        more = len(keys) - _KEYS_NAMED
        named = ", ".join(keys[:_KEYS_NAMED]) + (f" and {more} more" if more > 0 else "")
        super().__init__(f"checkpoint {path} holds keys this model does not have: {named} (no migration in "
                         "oryx_megatron/checkpoint/files.py RENAMED_KEYS maps them to its keys)")
        self.path, self.keys = Path(path), keys


class CheckpointVersionError(ValueError):
    """A checkpoint whose layout (``format_version``) this code does not know: not damaged, not skipped when
    resuming; the message names the checkpoint and the version."""

    def __init__(self, path, version):
        super().__init__(f"checkpoint {path} has format_version={version!r}, which this oryx-megatron does not know "
                         f"(it reads {', '.join(map(str, KNOWN_FORMAT_VERSIONS))}): written by a newer version?")
        self.path, self.version = Path(path), version


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


def model_key(key: str) -> Optional[str]:
    """The key of the model's parameter (or other state) that a sharded key belongs to: the key itself, or
    the parameter whose optimizer state it is; None for the run's own objects (RNG states, common state)."""
    if key in _RUN_OBJECTS:
        return None
    return _OPTIMIZER_STATE.sub("", key)


def sharded_keys(sharded_state: dict) -> Set[str]:
    """The keys of the sharded tensors and objects in a (nested) sharded state dict."""
    return {entry.key for entry in nested_values(sharded_state) if isinstance(entry, ShardedBase)}


def load_sharded(sharded_state: dict, path: Path, model_keys: Optional[Iterable[str]] = None) -> dict:
    """``dist_checkpointing.load``, also of a checkpoint written before a key was renamed: an
    entry the checkpoint lacks is read from its old spelling. The loaded state keeps the
    current names (it is keyed like ``sharded_state``). A checkpoint holding a key of a model
    state that the model does not have, under either spelling, is refused (CheckpointKeysError
    naming the keys): ``model_keys``, the keys of everything the model has (default: what
    ``sharded_state`` asks for; more when it asks for part of the model), on any rank (a pipeline stage
    holds its own layers)."""
    saved = {entry.key for entry in load_sharded_metadata(str(path)).values()}
    requested = [entry for entry in nested_values(sharded_state) if isinstance(entry, ShardedBase)]
    known = _every_rank({model_key(key) for key in (model_keys if model_keys is not None
                                                    else sharded_keys(sharded_state))})
    known |= {old_key(key) for key in known if key is not None}
    unknown = sorted({model_key(key) for key in saved} - known - {None})
    if unknown:
        raise CheckpointKeysError(path, unknown)
    for entry in requested:
        if entry.key not in saved and old_key(entry.key) in saved:
            entry.key = old_key(entry.key)
    return dist_checkpointing.load(sharded_state, str(path))


def _every_rank(keys: Set[Optional[str]]) -> Set[Optional[str]]:
    """The union of ``keys`` over the ranks of the default group (every rank loads; each holds its part)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return keys
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, keys)
    return set().union(*gathered)
