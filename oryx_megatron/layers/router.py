"""The chunk router: for each chunk of the sequence, the logit that its tokens should read attention.

Causal by construction: the logit of chunk c reads only the last token of chunk c - 1, through the
first layer's two reads of it (``MultiMixer.chunk_readouts``): per head the attention read minus the
linear read, and the linear read, each normed and gated as the layer's output is:

    f_c    = [y_attn - y_lin, y_lin](t = c * chunk - 1)      [h, 2, d_v], layer 1
    logit_c = w2 . gelu(W1 f_c + b1) + b2                     (c >= 1)
    logit_0 = a learned prior (no token precedes the first chunk)

Neither read depends on any token's mode, so every chunk's logit comes from one parallel pass over
the first layer, before any mode is chosen, the same in training and at inference (where a decode
step writes f of its token into the first layer's cache, ``MixerCache.readouts``). The difference
of the two reads is the attention-derived feature the "routing paradox" (arXiv 2603.20997) finds a
router needs: where the memories disagree, reading attention changes the output.

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
    """features [b, n, h_local, 2, d_v] (chunks 1..n) -> logits [b, n + 1] (chunks 0..n)."""

    def __init__(self, config: OryxConfig):
        super().__init__(config)
        hidden = config.router_hidden
        features = config.num_attention_heads * 2 * config.value_head_dim
        self.fc1 = RowParallelLinear(
            features, hidden, config=dataclasses.replace(config, sequence_parallel=False),  # chunks, not tokens
            init_method=config.init_method, bias=True, input_is_parallel=True, skip_bias_add=False,
        )
        self.fc2 = nn.Linear(hidden, 1, dtype=config.params_dtype)
        self.first = nn.Parameter(torch.zeros(1, dtype=config.params_dtype))  # the logit of chunk 0
        with torch.no_grad():  # every chunk starts at p = 0.5, the prior at 0
            self.fc2.weight.zero_()
            self.fc2.bias.zero_()
        # percentiles 0..100 of p(attention) over held-out chunks, written by router training: a budget's
        # threshold (NaN: not calibrated)
        self.register_buffer("calibration", torch.full((101,), torch.nan, dtype=torch.float64))
        # joint training's price of attention (the budget term's weight, adapted to hold the budget)
        self.register_buffer("price", torch.zeros((), dtype=torch.float64))

    def forward(self, features: Tensor) -> Tensor:
        b = features.shape[0]
        h, _ = self.fc1(features.flatten(2).transpose(0, 1))  # [n, b, hidden]
        logits = self.fc2(F.gelu(h))[..., 0].transpose(0, 1)  # [b, n]
        return torch.cat([self.first.expand(b, 1), logits], dim=1)

    def budget_threshold(self, budget: float) -> float:
        """The probability that (1 - budget) of the held-out chunks stay below: a budget's threshold."""
        threshold = float(self.calibration[round((1 - budget) * 100)])
        if threshold != threshold:
            raise ValueError(f"'router budget={budget}' needs a calibrated router (router training writes its "
                             "calibration); this one is not: use 'router threshold=P'")
        return threshold

    def allocate_readouts(self, batch_size: int, dtype, device, heads: int) -> Tensor:
        """The buffer a decode step writes the features of its token into: [b, h, 2, d_v]."""
        return torch.zeros(batch_size, heads, 2, self.config.value_head_dim, dtype=dtype, device=device)
