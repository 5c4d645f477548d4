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
from typing import List, Optional, Set

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


