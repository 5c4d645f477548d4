"""The one-token decode step, eager or replayed from CUDA graphs.

A decode step (one token per sequence, caches holding seqlen > 0) reads its positions from
the caches' device tensors and writes K/V in place, so one captured graph replays every step
of a (batch size, cache capacity, mode pattern) — the pattern being Mode.ATTENTION,
Mode.LINEAR, or a mixed modes tensor. The standard pattern: warm up on a side stream, capture,
then per step copy the inputs into the graph's static buffers and replay. Warm-up runs the
step for real and capture advances ``seqlen`` host-side, so both are undone with the caches'
snapshot/restore. A replay does not run Python, so the runner advances ``seqlen`` itself
(the in-graph ``position`` advances on replay). ``reserve`` growing a cache invalidates the
graphs (they hold the old buffers): they are dropped and recaptured at the new capacity. A
capture that raises (a kernel that cannot be captured, a GPU never tried) does not end the
generation: the step decodes eagerly from then on and says why (``capture_error``, logged).
"""

import dataclasses
import logging
import time
from typing import Callable, Dict, Optional, Tuple, Union

import torch
from torch import Tensor

from oryx_megatron.config import Mode
from oryx_megatron.inference.forward import cached_logits, restore, snapshot

StepFn = Callable[[Tensor, Union[Mode, Tensor]], Tensor]  # (ids [b, 1], modes) -> logits [b, V]
logger = logging.getLogger(__name__)


def use_cuda_graphs(requested: Optional[bool], device: torch.device) -> bool:
    """None: on for CUDA, off elsewhere; True off CUDA is an error."""
    if requested is None:
        return device.type == "cuda"
    if requested and device.type != "cuda":
        raise ValueError(f"cuda_graphs=True needs the model on a CUDA device; it is on {device}")
    return bool(requested)


def decode_step(model, caches, cuda_graphs: bool) -> StepFn:
    """The one-token step through ``caches``: a GraphedDecodeStep, or the eager forward.
    A step may carry ``capture_seconds`` (time spent capturing, not decoding) and ``capture_error``."""
    if cuda_graphs:
        return GraphedDecodeStep(model, caches)
    return eager_step(model, caches)


def eager_step(model, caches) -> StepFn:
    """The one-token step as a plain forward through ``caches``."""
    return lambda ids, modes: cached_logits(model, ids, modes, caches)[:, -1]


@dataclasses.dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph
    ids: Tensor  # [b, 1] static input
    modes: Union[Mode, Tensor]  # the Mode, or the static [b, 1] input of a mixed step
    logits: Tensor  # [b, V] static output


class GraphedDecodeStep:
    """``step(ids [b, 1], modes) -> logits [b, V]`` replayed from one CUDA graph per mode pattern; after a
    capture that raised, the eager step (``capture_error`` says why)."""

    def __init__(self, model, caches, warmup: int = 2):
        self.model, self.caches, self.warmup = model, caches, warmup
        self.graphs: Dict[Tuple[int, object], _Captured] = {}
        self.pool = None  # one memory pool for every graph, made at the first capture
        self.capture_seconds = 0.0
        self.capture_error: Optional[str] = None
        self.eager = eager_step(model, caches)

    def __call__(self, ids: Tensor, modes: Union[Mode, Tensor]) -> Tensor:
        if self.capture_error is not None:
            return self.eager(ids, modes)
        grown = [cache.reserve(cache.seqlen + 1) for cache in self.caches]  # every cache, no short-circuit
        if any(grown):
            self.graphs.clear()
        key = (ids.shape[0], modes if isinstance(modes, Mode) else "mixed")
        if key not in self.graphs:
            start, saved = time.perf_counter(), snapshot(self.caches)
            try:
                torch.cuda.synchronize()
                if self.pool is None:
                    self.pool = torch.cuda.graph_pool_handle()
                self.graphs[key] = self._capture(ids, modes)
                torch.cuda.synchronize()
            except Exception as e:  # decode on, eagerly, from the caches as they were before the capture
                restore(self.caches, saved)
                self.capture_error = f"{type(e).__name__}: {e}"
                logger.warning("CUDA-graph capture failed, decoding eagerly from here on: %s", self.capture_error)
                return self.eager(ids, modes)
            finally:
                self.capture_seconds += time.perf_counter() - start
        captured = self.graphs[key]
        captured.ids.copy_(ids)
        if isinstance(modes, Tensor):
            captured.modes.copy_(modes)
        captured.graph.replay()
        for cache in self.caches:
            cache.seqlen += 1
        return captured.logits.clone()  # the static output is overwritten by the next replay

    def _capture(self, ids: Tensor, modes: Union[Mode, Tensor]) -> _Captured:
        static_ids, static_modes = ids.clone(), modes if isinstance(modes, Mode) else modes.clone()

        def step():
            return cached_logits(self.model, static_ids, static_modes, self.caches)[:, -1]

        saved = snapshot(self.caches)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(self.warmup):
                step()
                restore(self.caches, saved)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            logits = step()
        restore(self.caches, saved)  # capture ran no kernel but advanced seqlen host-side
        return _Captured(graph, static_ids, static_modes, logits)
