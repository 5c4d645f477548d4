"""What differs between the megatron-core releases this project supports (``>=0.16.1,<0.20``), in one place.

Each difference is detected from what is there (a file, an entry of ``.metadata``), never from a version
number; nothing else in the project reads megatron-core's version (tests/test_structure.py checks).

- **The common state** (iteration, scheduler, loader, layout, run id, optimizer param groups: what
  ``dist_checkpointing.save`` is given besides sharded tensors and objects): up to 0.18 the save writes it
  to ``common.pt`` beside the shards; from 0.19 it travels inside the shards as the ShardedObject
  ``common_state``. ``common_state_location`` finds it in either place, in megatron 0.19's own order
  (``load_common_state_dict``: ``common.pt`` when the checkpoint has one).
- **Shard files**: the torch_dist save writes two ``__<rank>_<n>.distcp`` files per rank up to 0.16
  (``thread_count`` 2) and one from 0.17. Nothing counts them: verification follows ``.metadata``.
- **CUDA on the CPU**: 0.19's DDP grad sync calls ``torch.cuda.current_stream()`` on every step;
  ``compat.cpu`` answers it with the CPU stream (on every version).
- **Asynchronous saves** (``save_request``): ``dist_checkpointing.save(..., async_sharded_save=True)`` returns the
  AsyncRequest that writes the shards, run by megatron's ``AsyncCallsQueue`` (same module and interface in every
  release). From 0.19 the save also takes an ``async_strategy``, whose default (NVIDIA's resiliency extension,
  ``nvidia_resiliency_ext``) is not installed: megatron's own, ``"mcore"``, is asked for where the torch strategy
  module offers the choice (its ``get_async_strategy``). 0.19 logs once that "MCore's async save is deprecated".
- **Write results** (``discard_write_results``): every release hands a save's write results from its writer to its
  finalize through ONE queue per process (``filesystem_async._results_queue``), from which the finalize takes the
  first item. Results a save left there (its finalize never ran: the save failed, or its run did) would be read
  as the next save's, whose ``.metadata`` would then describe the other save's files. The queue lives in a
  manager process (spawned, of the trainer's process group): made here, that process ignores SIGTERM and SIGINT,
  since torchrun (to a worker's process group) and SLURM (to every process of a job step) send the preemption
  signal to it too, and a dead manager failed the save that the signal asked for. It ends with the trainer.
- **The static inference context** (the Transformer baseline's KV cache, ``models.transformer``): built the
  same way in every release; whether a forward materialises only the last position's logits is the context's
  ``materialize_only_last_token_logits`` up to 0.18, its ``config``'s (an ``InferenceConfig``) from 0.19
  (``last_token_logits_only``), where megatron reads it only while its engine's ``InferenceMode`` is active:
  not set here, so 0.19 computes every position's logits and the model keeps the last.
- **The context-parallel batch split** (``batch_on_this_cp_rank``): ``get_batch_on_this_cp_rank(batch, cp_group)``
  up to 0.18; 0.19 adds a required ``is_hybrid_cp`` (hybrid CP, variable CP sizes per sample: not used here) and
  no longer defaults the group to the context-parallel one. Both are given the CP group explicitly.
- **The GPT layer spec's MLP** (``mlp_submodules``): a ``ModuleSpec(MLP, submodules=...)`` up to 0.18; from 0.19 a
  ``functools.partial(MLP.as_mlp_submodule, submodules=...)``. Either way its ``MLPSubmodules`` are found.
"""

import functools
import inspect
import io
import multiprocessing
import signal
from multiprocessing.managers import SyncManager
from pathlib import Path
from typing import NamedTuple, Optional

import torch

COMMON_FILE = "common.pt"
# The fqn of the common_state object in .metadata: ShardedObject("common_state", ..., (1,), (0,)).unique_key
COMMON_OBJECT = "common_state/shard_0_1"


class Location(NamedTuple):
    """Where a checkpoint's common state lies: bytes [offset, offset + length) of ``file`` (relative to
    the checkpoint); ``name`` says where in messages."""

    file: str
    offset: int
    length: int
    name: str

    def load(self, checkpoint: Path):
        """The common state, by ``torch.load(weights_only=True)`` (no code in the pickle runs); None when
        the object is not a one-item list (a sharded object's bytes hold [its data])."""
        with open(Path(checkpoint) / self.file, "rb") as f:
            f.seek(self.offset)
            loaded = torch.load(io.BytesIO(f.read(self.length)), map_location="cpu", weights_only=True)
        if self.file == COMMON_FILE:
            return loaded
        return loaded[0] if isinstance(loaded, list) and len(loaded) == 1 else None


def common_state_location(checkpoint: Path, metadata) -> Optional[Location]:
    """The common state of the checkpoint at ``checkpoint``: ``common.pt`` when it has one, else the
    ``common_state`` object that ``metadata`` (its loaded ``.metadata``) places in a shard; None when it
    has neither."""
    file = Path(checkpoint) / COMMON_FILE
    if file.is_file():
        return Location(COMMON_FILE, 0, file.stat().st_size, COMMON_FILE)
    for index, info in dict(metadata.storage_data).items():
        if index.fqn == COMMON_OBJECT:
            return Location(info.relative_path, info.offset, info.length,
                            f"{info.relative_path}: object {COMMON_OBJECT}")
    return None


def save_request(sharded_state: dict, path):
    """``dist_checkpointing.save`` of ``sharded_state`` into the directory ``path``, asynchronously: megatron writes
    the common state and plans the shards now, on every rank, and returns the AsyncRequest whose ``async_fn``
    writes this rank's shards and whose finalize functions (on every rank, once every rank has written) write
    ``.metadata`` and ``metadata.json``."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies import torch as torch_strategy

    choice = {"async_strategy": "mcore"} if hasattr(torch_strategy, "get_async_strategy") else {}
    return dist_checkpointing.save(sharded_state, str(path), async_sharded_save=True, **choice)


def _ignore_termination() -> None:
    """The write results' manager process: a preemption signal is for the trainer (the module docstring)."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def discard_write_results() -> int:
    """Empty megatron's queue of write results (the module docstring), made first if megatron has none yet;
    how many results it held."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if filesystem_async._results_queue is None:  # megatron's own: a manager that a SIGTERM ends
        manager = SyncManager(ctx=multiprocessing.get_context("spawn"))
        manager.start(_ignore_termination)  # the queue's proxy holds the manager; its finalizer ends it
        filesystem_async._results_queue = manager.Queue()
    results, discarded = filesystem_async._results_queue, 0
    while results is not None and not results.empty():
        results.get()
        discarded += 1
    return discarded


def static_inference_context(batch_size: int, capacity: int):
    """megatron's static-batching inference context for ``batch_size`` sequences of up to ``capacity`` tokens
    (imported here, at first use: its package pulls in megatron's whole inference engine)."""
    from megatron.core.inference.contexts import StaticInferenceContext

    return StaticInferenceContext(batch_size, capacity)


def last_token_logits_only(context, last_only: bool) -> None:
    """Make the next forward through ``context`` compute the logits of the last position only, or of all."""
    holder = context if hasattr(context, "materialize_only_last_token_logits") else context.config
    holder.materialize_only_last_token_logits = last_only


def batch_on_this_cp_rank(batch: dict) -> dict:
    """megatron's ``get_batch_on_this_cp_rank`` over the context-parallel group (the module docstring)."""
    from megatron.core import parallel_state
    from megatron.core.utils import get_batch_on_this_cp_rank

    group = parallel_state.get_context_parallel_group()
    if "is_hybrid_cp" in inspect.signature(get_batch_on_this_cp_rank).parameters:
        return get_batch_on_this_cp_rank(batch, is_hybrid_cp=False, cp_group=group)
    return get_batch_on_this_cp_rank(batch, cp_group=group)


def mlp_submodules(layer_spec):
    """The ``MLPSubmodules`` (linear_fc1, linear_fc2) of a GPT layer spec's MLP (the module docstring)."""
    mlp = layer_spec.submodules.mlp
    return mlp.keywords["submodules"] if isinstance(mlp, functools.partial) else mlp.submodules
