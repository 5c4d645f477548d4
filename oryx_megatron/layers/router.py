"""The chunk router: for each chunk of the sequence, the logit that its tokens should read attention.

Causal by construction: the logit of chunk c reads only the chunk's first token and the tokens
before it, through the first layer's two reads of that token (``MultiMixer.chunk_readouts``): per
head the attention read minus the linear read, and the linear read, each normed and gated as the
layer's output is:

    f_c     = [y_attn - y_lin, y_lin](t = c * chunk)          [h, 2, d_v], layer 1
    logit_c = w2 . gelu(W1 f_c + b1) + b2

Every token of chunk c sits at or after its first token, so the model stays causal: a token's output
depends on no later token through its mode. The first token is the one that can say a chunk needs
attention (a query key, a name asked about), which the token before it often cannot; the price is a
decision made inside the chunk's first step at decode (``OryxModel.route_step``: one more step of the
first layer's mixer per chunk). Neither read depends on any token's mode, so every chunk's logit
comes from one parallel pass over the first layer, before any mode is chosen. The difference of the
two reads is the attention-derived feature the "routing paradox" (arXiv 2603.20997) finds a router
needs: where the memories disagree, reading attention changes the output.

Tensor parallelism: f is split with its heads, so W1 is row-parallel (an all-reduce of [n, b, r]).
"""

import dataclasses

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel import RowParallelLinear
from megatron.core.transformer.module import MegatronModule
from torch import Tensor, nn

from oryx_megatron.config import OryxConfig


class ChunkRouter(MegatronModule):
    """features [b, n, h_local, 2, d_v] -> logits [b, n] (chunks 0..n-1)."""

    def __init__(self, config: OryxConfig):
        super().__init__(config)
        hidden = config.router_hidden
        features = config.num_attention_heads * 2 * config.value_head_dim
        self.fc1 = RowParallelLinear(
            features, hidden, config=dataclasses.replace(config, sequence_parallel=False),  # chunks, not tokens
            init_method=config.init_method, bias=True, input_is_parallel=True, skip_bias_add=False,
        )
        self.fc2 = nn.Linear(hidden, 1, dtype=config.params_dtype)
        with torch.no_grad():  # every chunk starts at p = 0.5
            self.fc2.weight.zero_()
            self.fc2.bias.zero_()
        # percentiles 0..100 of p(attention) over held-out chunks, written by router training: a budget's
        # threshold (NaN: not calibrated)
        self.register_buffer("calibration", torch.full((101,), torch.nan, dtype=torch.float64))
        # joint training's price of attention (the budget term's weight, adapted to hold the budget)
        self.register_buffer("price", torch.zeros((), dtype=torch.float64))

    def forward(self, features: Tensor) -> Tensor:
        h, _ = self.fc1(features.flatten(2).transpose(0, 1))  # [n, b, hidden]
        return self.fc2(F.gelu(h))[..., 0].transpose(0, 1)  # [b, n]

    def budget_threshold(self, budget: float) -> float:
        """The probability that (1 - budget) of the held-out chunks stay below: a budget's threshold."""
        threshold = float(self.calibration[round((1 - budget) * 100)])
        if threshold != threshold:
            raise ValueError(f"'router budget={budget}' needs a calibrated router (router training writes its "
                             "calibration); this one is not: use 'router threshold=P'")
        return threshold
