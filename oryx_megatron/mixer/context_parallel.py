"""Context parallelism of the mixer by head all-to-all (Ulysses; megatron's ``MambaContextParallel`` for
Mamba-2): a context-parallel rank holds a part of every sequence, the projections and the MLP run on it, and the
mixing runs on the whole sequence for a share of the heads.

    projection [b, s / cp, h, w]   this rank's tokens (chunks r and 2cp - 1 - r of 2cp: megatron's load-balanced
        | to_heads                 split, ``get_batch_on_this_cp_rank``), every head of this TP rank
    streams    [b, s, h / cp, w]   the whole sequence in order, this rank's heads: convs, both mixers, selection
        | to_sequence
    reads      [b, s / cp, h, d_v] back to this rank's tokens, every head, for the shared W_O

Every per-head parameter is replicated over the context-parallel ranks (their gradients are reduced over data x
context parallel ranks, as megatron's DDP does); a rank computes with its heads' slice (``HeadModule.local``).
One all-to-all before the mixing and one after; the modes and packed documents of the whole sequence are in the
forward's ``MixerContext`` on every rank.
"""

from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor


class ContextParallel:
    """The context-parallel group of a mixer (None, or a group of one rank: no context parallelism)."""

    def __init__(self, group: Optional[dist.ProcessGroup] = None):
        self.group = group
        self.size = 1 if group is None else group.size()
        self.rank = 0 if group is None else group.rank()

    def to_heads(self, x: Tensor) -> Tensor:
        """[b, s / cp, h, w] of this rank's tokens -> [b, s, h / cp, w]: every token in order, this rank's heads."""
        if self.size == 1:
            return x
        b, s_local, h, w = x.shape
        parts = x.reshape(b, s_local, self.size, h // self.size, w).permute(2, 0, 1, 3, 4).contiguous()
        gathered = self._all_to_all(parts)  # [cp: the rank the tokens came from, b, s / cp, h / cp, w]
        return self._in_order(gathered.permute(1, 0, 2, 3, 4).reshape(b, self.size * s_local, h // self.size, w))

    def to_sequence(self, y: Tensor) -> Tensor:
        """[b, s, h / cp, d] -> [b, s / cp, h, d]: this rank's tokens, every head (the inverse of ``to_heads``)."""
        if self.size == 1:
            return y
        b, s, h_local, d = y.shape
        parts = self._balanced(y).reshape(b, self.size, s // self.size, h_local, d).permute(1, 0, 2, 3, 4)
        scattered = self._all_to_all(parts.contiguous())  # [cp: the rank whose heads these are, b, s / cp, h / cp, d]
        return scattered.permute(1, 2, 0, 3, 4).reshape(b, s // self.size, self.size * h_local, d)

    def all_heads(self, x: Tensor) -> Tensor:
        """[b, n, h / cp, ...] of this rank's heads -> [b, n, h, ...]: every rank's, gathered (differentiable)."""
        if self.size == 1:
            return x
        return _Gather.apply(x.contiguous(), self.group, 2)

    def all_tokens(self, x: Tensor) -> Tensor:
        """[b, s / cp, ...] of this rank's tokens -> [b, s, ...]: every rank's, in sequence order (differentiable;
        features of the hidden state that every head reads)."""
        if self.size == 1:
            return x
        return self._in_order(_Gather.apply(x.contiguous(), self.group, 1))

    def _all_to_all(self, x: Tensor) -> Tensor:
        """Part i of dim 0 to rank i, part j of the result from rank j (differentiable)."""
        return _AllToAll.apply(x, self.group)

    def _in_order(self, x: Tensor) -> Tensor:
        """[b, s, ...] in the ranks' order (rank r's chunks r and 2cp - 1 - r) -> in sequence order."""
        chunks = x.chunk(2 * self.size, dim=1)  # chunk 2r: sequence chunk r, 2r + 1: chunk 2cp - 1 - r
        order = [2 * i for i in range(self.size)] + [2 * (self.size - 1 - i) + 1 for i in range(self.size)]
        return torch.cat([chunks[i] for i in order], dim=1)

    def _balanced(self, x: Tensor) -> Tensor:
        """[b, s, ...] in sequence order -> in the ranks' order (the inverse of ``_in_order``)."""
        chunks = x.chunk(2 * self.size, dim=1)
        order = [c for r in range(self.size) for c in (r, 2 * self.size - 1 - r)]
        return torch.cat([chunks[i] for i in order], dim=1)


class _AllToAll(torch.autograd.Function):
    """``dist.all_to_all_single`` with equal parts along dim 0; its gradient is the same exchange back."""

    @staticmethod
    def forward(ctx, x: Tensor, group) -> Tensor:
        ctx.group = group
        return _exchange(x, group)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return _exchange(grad, ctx.group), None


def _exchange(x: Tensor, group) -> Tensor:
    x = x.contiguous()
    out = torch.empty_like(x)  # contiguous like x: the collective reads and writes flat buffers
    dist.all_to_all_single(out, x, group=group)
    return out


class _Gather(torch.autograd.Function):
    """Every rank's part concatenated along ``dim``; the gradient of this rank's part sums every rank's gradient
    of it (each rank's loss reads all the parts)."""

    @staticmethod
    def forward(ctx, x: Tensor, group, dim: int) -> Tensor:
        ctx.group, ctx.dim = group, dim
        parts = [torch.empty_like(x) for _ in range(group.size())]
        dist.all_gather(parts, x, group=group)
        return torch.cat(parts, dim=dim)

    @staticmethod
    def backward(ctx, grad: Tensor):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad.chunk(ctx.group.size(), dim=ctx.dim)[ctx.group.rank()], None, None
