"""megatron's column- and row-parallel linears of the local spec, with a plain ``F.linear`` where nothing is
parallel and nothing is differentiated (inference at TP=1: a decode step, a prefill, an evaluation).

megatron's forward goes through an autograd Function (``LinearWithGradAccumulationAndAsyncCommunication``), its
argument checks and the communication calls that are no-ops on one rank: at a decode step of a tiny model that
costs more than the matrix product. Under autograd, or with more than one tensor-parallel rank, the forward is
megatron's own. The parameters, their names and checkpoints are megatron's (these are subclasses).
"""

from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from torch import Tensor


def rematerialised(module: torch.nn.Module) -> bool:
    """Whether megatron (0.19+) shards ``module``'s weight over its gtp_remat group and rematerialises it in its own
    forward: a plain forward reading the weight as it lies would be wrong there."""
    return getattr(module, "gtp_remat_size", 1) > 1


class _PlainAtOneRank:
    """The shared fast path: at TP=1 without autograd, (F.linear(x, weight[, bias]), bias if skip_bias_add)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.solo = self.tp_group.size() == 1 and not rematerialised(self)

    def _plain(self, input_: Tensor, weight: Tensor) -> Optional[Tuple[Tensor, Optional[Tensor]]]:
        """The plain forward, or None where megatron's own must run (TP > 1, or under autograd)."""
        if not self.solo or torch.is_grad_enabled():
            return None
        if self.skip_bias_add:
            return F.linear(input_, weight), self.bias
        return F.linear(input_, weight, self.bias), None


class ColumnLinear(_PlainAtOneRank, ColumnParallelLinear):
    """``ColumnParallelLinear``, plain at TP=1 without autograd."""

    def forward(self, input_: Tensor, weight: Optional[Tensor] = None,
                runtime_gather_output: Optional[bool] = None) -> Tuple[Tensor, Optional[Tensor]]:
        plain = self._plain(input_, self.weight if weight is None else weight)
        return plain if plain is not None else super().forward(input_, weight, runtime_gather_output)


class RowLinear(_PlainAtOneRank, RowParallelLinear):
    """``RowParallelLinear``, plain at TP=1 without autograd."""

    def forward(self, input_: Tensor) -> Tuple[Tensor, Optional[Tensor]]:
        plain = self._plain(input_, self.weight)
        return plain if plain is not None else super().forward(input_)
