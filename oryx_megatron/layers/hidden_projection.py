"""``HiddenProjection``: a linear mixer's cross-head features of the hidden state (``LinearMixer.hidden_projections``,
e.g. a low-rank gate's first stage) as a megatron part. Every head reads every feature, and tensor parallelism
splits heads, so the weight is replicated over the tensor-parallel ranks and each rank's output holds every
feature of every token:

    hidden [s (/ tp under SP), b, hidden] -> W x -> [s (/ tp), b, features]
        sequence parallel:  all-gather the sequence (backward: reduce-scatter); the weight's gradient, of this
                            rank's tokens, is summed over TP by megatron's finalize_model_grads (``sequence_parallel``)
        otherwise:          identity (backward: all-reduce over TP, each rank's heads' share of the gradient;
                            not megatron's copy_to_tensor_model_parallel_region, whose backward reduces a copy of a
                            non-contiguous gradient and returns the gradient unreduced, as this one's is: the
                            core reads the features transposed to [b, s, ..])

Its weight checkpoints as one replicated tensor (``mixer.hidden_proj.weight``), the name the Hugging Face model's
``nn.Linear`` has.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region
from torch import Tensor, nn

from oryx_megatron.layers.config import OryxConfig


class HiddenProjection(nn.Module):
    """hidden [s (/ tp), b, hidden] -> [s, b, features], the same on every tensor-parallel rank."""

    def __init__(self, config: OryxConfig, features: int, tp_group, device=None):
        super().__init__()
        self.sequence_parallel, self.tp_group = config.sequence_parallel, tp_group
        self.weight = nn.Parameter(torch.empty(features, config.hidden_size, dtype=config.params_dtype, device=device))
        self.weight.sequence_parallel = config.sequence_parallel
        if config.perform_initialization:  # drawn whole on the CPU generator: every TP size starts the same
            full = torch.empty(features, config.hidden_size, device="cpu")
            config.init_method(full)
            with torch.no_grad():
                self.weight.copy_(full)

    def forward(self, hidden: Tensor) -> Tensor:
        y = F.linear(hidden, self.weight)
        if self.sequence_parallel:
            return gather_from_sequence_parallel_region(y, group=self.tp_group)
        return _ReduceGradient.apply(y, self.tp_group)


class _ReduceGradient(torch.autograd.Function):
    """The identity; its gradient summed over ``group`` (each rank's heads read the same features)."""

    @staticmethod
    def forward(ctx, x: Tensor, group) -> Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor):
        if ctx.group.size() > 1:
            grad = grad.contiguous()
            dist.all_reduce(grad, group=ctx.group)
        return grad, None
