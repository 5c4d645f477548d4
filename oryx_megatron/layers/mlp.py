"""megatron's MLP of the local spec, plain at TP=1 without autograd (a decode step, a prefill, an evaluation): the
reason of layers/linear.py one level up.

megatron's forward opens NVTX ranges, walks its activation branches on every call, adds ``glu_linear_offset`` (0.0)
to the linear half of the GLU and calls both linears as modules: at a decode step of a tiny model that costs as much
as the matrix products. Where nothing is parallel or differentiated, and the MLP is the plain SwiGLU (or one
activation) without biases, its forward here is fc1 -> act(a) * b -> fc2 on the same parameters; otherwise it is
megatron's own. Parameters, names and checkpoints are megatron's (a subclass).
"""

import torch
import torch.nn.functional as F
from megatron.core.transformer.mlp import MLP as MegatronMLP
from torch import Tensor

from oryx_megatron.layers.linear import ColumnLinear, RowLinear


class MLP(MegatronMLP):
    """``megatron.core.transformer.mlp.MLP``, plain at TP=1 without autograd."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        c = self.config
        self.plain = (isinstance(self.linear_fc1, ColumnLinear) and isinstance(self.linear_fc2, RowLinear)
                      and self.linear_fc1.solo and not c.add_bias_linear and not c.use_te_activation_func
                      and c.activation_func_clamp_value is None and c.glu_linear_offset == 0.0)

    def forward(self, hidden_states: Tensor, per_token_scale=None, **kwargs):
        if not self.plain or per_token_scale is not None or torch.is_grad_enabled():
            return super().forward(hidden_states, per_token_scale, **kwargs)
        h = F.linear(hidden_states, self.linear_fc1.weight)  # [s, b, ffn (x 2 for a GLU)]
        if self.config.gated_linear_unit:
            a, b = h.chunk(2, dim=-1)
            h = self.config.activation_func(a) * b
        else:
            h = self.config.activation_func(h)
        return F.linear(h, self.linear_fc2.weight), None
