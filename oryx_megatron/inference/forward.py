"""What every decoding loop shares: the model checks, eval mode, and one forward through the caches."""

import contextlib
from typing import Optional, Tuple, Union

import numpy as np
import torch
from megatron.core.parallel_state import get_tensor_model_parallel_world_size
from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region
from torch import Tensor

from oryx_megatron.config import Mode
from oryx_megatron.data.documents import document_ids as count_documents


def check_model(model: torch.nn.Module) -> Tuple[torch.device, torch.dtype]:
    """The device and dtype of a model that can decode with caches; else a TypeError/ValueError."""
    if not hasattr(model, "allocate_inference_cache"):
        raise TypeError(f"generation needs a model with an inference cache (allocate_inference_cache), "
                        f"got {type(model).__name__}")
    if not (getattr(model, "pre_process", True) and getattr(model, "post_process", True)):
        raise ValueError("generation needs the whole model on one pipeline stage (pipeline_model_parallel_size=1)")
    param = next(model.parameters())
    return param.device, param.dtype


@contextlib.contextmanager
def eval_mode(model: torch.nn.Module):
    """Eval mode and no autograd inside; the model gets its training flag back after."""
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        model.train(was_training)


def mode_arg(host_modes: np.ndarray, modes: Tensor) -> Union[Mode, Tensor]:
    """The ``modes`` argument of one call: a Mode when every token reads one mode (decided on the
    host copy host_modes [b, s], no device sync), else the device tensor modes [b, s]."""
    first = host_modes.flat[0]
    return Mode(int(first)) if (host_modes == first).all() else modes


def cached_logits(model, ids: Tensor, modes: Union[Mode, Tensor], caches, last_only: bool = False,
                  document_ids: Optional[Tensor] = None) -> Tensor:
    """Feed ids [b, s] through the caches; the full-vocab logits of every position [b, s, V], or of
    the last one [b, 1, V] with ``last_only`` (a prefill). ``document_ids`` [b, s]: packed documents
    (``reset_documents``)."""
    logits = model(ids, modes, inference_cache=caches, last_token_logits=last_only, document_ids=document_ids)
    if last_only:
        logits = logits[:, -1:]  # under sequence parallelism the model returns every position
    if getattr(model, "parallel_output", False) and get_tensor_model_parallel_world_size() > 1:
        logits = gather_from_tensor_model_parallel_region(logits)  # vocab shards -> full vocab
    return logits


def snapshot(caches) -> list:
    """A snapshot of every layer's cache (``MixerCache.snapshot``)."""
    return [cache.snapshot() for cache in caches]


def restore(caches, saved: list) -> None:
    """Every layer's cache back to its snapshot, in place."""
    for cache, state in zip(caches, saved):
        cache.restore(state)


def prompt_documents(ids: Tensor, eod_id: Optional[int]) -> Optional[Tensor]:
    """The document ids [b, s] of prompt tokens ids [b, s] for a model trained with data.reset_at_eod
    (``eod_id``: its EOD token; a token after an EOD starts a document), None otherwise."""
    return None if eod_id is None else count_documents(ids, eod_id)


def reset_documents(caches, previous: Tensor, eod_id: Optional[int]) -> None:
    """Before feeding the next token: every layer's states restart where ``previous`` [b] (the token fed
    last) is the EOD token (``MixerCache.start_documents``); nothing without ``eod_id``."""
    if eod_id is not None:
        starting = previous == eod_id
        for cache in caches:
            cache.start_documents(starting)
