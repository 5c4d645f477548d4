"""One training step's pieces: micro-batches through megatron's pipeline schedule, the loss and its
per-mode sums, the finiteness check and gradient clipping, and the bookkeeping of the steps between
two log lines (``Interval``, ``LossSpikeDetector``)."""

import collections
import logging
import math
import time
from functools import partial
from typing import Dict, List, Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32
from megatron.core.pipeline_parallel import get_forward_backward_func

from oryx_megatron.config import Mode
from oryx_megatron.parallel import current_device, this_rank_tokens
from oryx_megatron.run_config import TrainConfig

logger = logging.getLogger("oryx_megatron.train")


def forward_backward(run: TrainConfig, model, loaders, forward_only: bool, routing=None) -> List[dict]:
    """The global batch through megatron's pipeline schedule; the micro-batches' loss reports. ``routing``: a
    ``JointRouting`` (router=joint, training only: evaluation keeps its schedules), whose forward step draws the
    modes; else the batches' modes are read."""
    t = run.train
    num_microbatches = t.global_batch_size // (t.micro_batch_size * parallel_state.get_data_parallel_world_size())
    iterators = loaders if len(loaders) > 1 else loaders[0]
    return get_forward_backward_func()(
        forward_step_func=_forward_step if routing is None else routing.forward_step,
        data_iterator=iterators,
        model=model if len(model) > 1 else model[0],
        num_microbatches=num_microbatches,
        seq_length=run.data.seq_length,
        micro_batch_size=t.micro_batch_size,
        forward_only=forward_only,
    )


def get_batch(data_iterator, device: torch.device) -> Dict[str, torch.Tensor]:
    """The next micro-batch on ``device``; to a GPU from pinned host memory, without blocking."""
    batch = next(data_iterator)
    pin = device.type == "cuda"
    return {key: (t.pin_memory() if pin else t).to(device, non_blocking=pin) for key, t in batch.items()}


def _forward_step(data_iterator, model):
    batch = get_batch(data_iterator, current_device())
    local = this_rank_tokens(tokens=batch["tokens"], labels=batch["labels"], loss_mask=batch["loss_mask"],
                             modes=batch["modes"])
    output = model(local["tokens"], batch["modes"], labels=local["labels"], document_ids=batch.get("document_ids"))
    return output, partial(loss_func, local["loss_mask"], local["modes"])


def loss_func(loss_mask, modes, per_token_loss):
    """Token-summed loss and token count (megatron divides by the global count), plus the sums over
    attention-mode tokens for per-mode logging. ``modes`` [b, s]: Mode values, or joint routing's read weights
    (training/joint_routing.py, whose ``routed_loss_func`` adds the router's terms to this one)."""
    mask = loss_mask.float()
    losses = per_token_loss.float() * mask
    # joint routing's weights are a + p - p.detach(): 0/1 up to rounding (1 + p - p is not always 1)
    reads_attention = modes.detach() > 0.5 if modes.is_floating_point() else modes == Mode.ATTENTION
    attention = reads_attention.float() * mask
    total, count = losses.sum(), mask.sum()
    report = torch.stack([total, count, (losses * attention).sum(), attention.sum()]).detach()
    return total, count.int(), {"loss_sums": report}


class Interval:
    """Loss sums, gradient norms and wall time of the steps since the last log line, and the
    steps skipped (non-finite) and loss spikes among them."""

    def __init__(self):
        self.start, self.loss_sums, self.grad_norms = time.perf_counter(), 0, []
        self.steps = self.skipped = self.spikes = 0

    def add(self, loss_sums: torch.Tensor, grad_norm: Optional[float]) -> None:
        """One step; ``grad_norm`` None: a skipped step (its loss is not averaged)."""
        self.steps += 1
        if grad_norm is None:
            self.skipped += 1
        else:
            self.loss_sums, self.grad_norms = self.loss_sums + loss_sums, self.grad_norms + [grad_norm]

    def seconds_per_step(self) -> float:
        return (time.perf_counter() - self.start) / max(self.steps, 1)

    def mean_grad_norm(self) -> float:
        return sum(self.grad_norms) / len(self.grad_norms) if self.grad_norms else float("nan")


class LossSpikeDetector:
    """Flags (logs) a loss above mean + ``threshold`` standard deviations of the previous
    ``window`` finite losses (once ``window // 2`` are known); threshold <= 0 disables it. A
    spike is only reported: the step is taken (a non-finite loss is skipped instead)."""

    def __init__(self, window: int, threshold: float):
        self.losses, self.threshold = collections.deque(maxlen=max(window, 2)), threshold

    def add(self, iteration: int, loss: float) -> bool:
        history, spike = self.losses, False
        if self.threshold > 0 and len(history) >= max(history.maxlen // 2, 2):
            mean = sum(history) / len(history)
            std = (sum((x - mean) ** 2 for x in history) / len(history)) ** 0.5
            if loss > mean + self.threshold * std:
                spike = True
                logger.warning("iteration %d: loss spike %.4f > mean %.4f + %g x std %.4f of the last %d steps",
                               iteration, loss, mean, self.threshold, std, len(history))
        history.append(loss)
        return spike


def all_finite(loss_sums: torch.Tensor, grad_norm, found_inf: bool) -> bool:
    """Whether the loss and gradient norm are finite on every rank (one all-reduce)."""
    bad = bool(found_inf) or not torch.isfinite(loss_sums).all().item() or not math.isfinite(float(grad_norm))
    flag = torch.tensor([float(bad)], device=current_device())
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return flag.item() == 0


def clip_grads(optimizer, grad_norm: float) -> None:
    """What megatron's ``optimizer.step()`` does between ``prepare_grads`` and the update:
    clip by the total norm already computed."""
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        params = [] if getattr(opt, "is_stub_optimizer", False) else opt.get_parameters()
        if params and opt.config.clip_grad > 0.0:
            clip_grad_by_total_norm_fp32(params, max_norm=opt.config.clip_grad, total_norm=grad_norm,
                                         use_decoupled_grad=opt.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8)


def sum_losses(reports: List[dict]) -> torch.Tensor:
    """[loss sum, tokens, attention-mode loss sum, attention-mode tokens] of the global batch
    (micro-batches summed, all-reduced over data-parallel and context-parallel ranks); zeros off the last
    stage."""
    sums = torch.zeros(4, dtype=torch.float64, device=current_device())
    if reports:
        sums = torch.stack([r["loss_sums"] for r in reports]).sum(0).double()
        dist.all_reduce(sums, group=parallel_state.get_data_parallel_group(with_context_parallel=True))
    return sums


def loss_metrics(sums: torch.Tensor, split: str) -> Dict[str, float]:
    total, count, attn_total, attn_count = sums.tolist()
    if not count:  # not the last pipeline stage: nothing to report
        return {}
    lin_count = count - attn_count
    return {
        f"{split}/loss": total / count,
        f"{split}/loss_attention": attn_total / attn_count if attn_count else float("nan"),
        f"{split}/loss_linear": (total - attn_total) / lin_count if lin_count else float("nan"),
        f"{split}/attention_fraction": attn_count / count,
    }

