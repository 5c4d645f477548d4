"""The chunk router: for each chunk of the sequence, the logit that its tokens should read attention.

Causal by construction: the logit of chunk c reads only the chunk's first token and the tokens before it,
through the first layer's two reads of that token (``OryxMixer.chunk_readouts``): per head the attention
read minus the linear read, and the linear read, each normed and gated as the layer's output is:

    f_c     = [y_attn - y_lin, y_lin](t = c * chunk)          [h, 2, d_v], layer 1
    logit_c = w2 . gelu(W1 f_c + b1) + b2

With ``router_layers`` L > 1 it reads the same two reads in each of the first L layers of an all-linear
pass, f_c [h, L, 2, d_v] (``OryxModel.route``): a deeper layer's reads depend on the layers below, and those
are read all-linear, whatever modes are chosen, so the logits still come before any mode.

Every token of chunk c sits at or after its first token, so the model stays causal: a token's output
depends on no later token through its mode. The first token is the one that can say a chunk needs
attention (a query key, a name asked about), which the token before it often cannot; the price is a
decision made inside the chunk's first step at decode (one more step of the first layer's mixer per chunk,
on a snapshot of its cache). Neither read depends on any token's mode, so every chunk's logit comes from one
parallel pass over the first layer, before any mode is chosen. The difference of the two reads is the
attention-derived feature the "routing paradox" (arXiv 2603.20997) finds a router needs: where the memories
disagree, reading attention changes the output.

Tensor parallelism: f is split with its heads, so a megatron front end makes W1 row-parallel
(layers/router.py).
"""

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from oryx_megatron.config import MixerConfig


# p(attention) from which a chunk reads attention of the router's own accord: the floor of a budget's threshold
# (inference/routing.py) and the share a joint router's price holds to its budget (training/steps.py)
ROUTER_THRESHOLD = 0.5


def router_features(config: MixerConfig) -> int:
    """The router's inputs per chunk: per head and routed layer, the two reads (d_v each)."""
    return config.num_attention_heads * config.router_layers * 2 * config.value_head_dim


class ChunkRouter(nn.Module):
    """features [b, n, h, layers, 2, d_v] (or [b, n, h, 2, d_v] of one layer) -> logits [b, n] (chunks
    0..n-1); ``fc1``: W1 (default a plain nn.Linear); ``dtype``: of the parameters (None: torch's default)."""

    def __init__(self, config: MixerConfig, dtype: Optional[torch.dtype] = None, fc1: Optional[nn.Module] = None):
        super().__init__()
        hidden = config.router_hidden
        features = router_features(config)
        self.fc1 = nn.Linear(features, hidden, dtype=dtype) if fc1 is None else fc1
        self.fc2 = nn.Linear(hidden, 1, dtype=dtype)
        with torch.no_grad():  # every chunk starts at p = 0.5
            self.fc2.weight.zero_()
            self.fc2.bias.zero_()
        # percentiles 0..100 of p(attention) over held-out chunks, written by router training: a budget's
        # threshold (NaN: not calibrated)
        self.register_buffer("calibration", torch.full((101,), torch.nan, dtype=torch.float64))
        # joint training's price of attention (the budget term's weight, adapted to hold the budget)
        self.register_buffer("price", torch.zeros((), dtype=torch.float64))

    def forward(self, features: Tensor) -> Tensor:
        return self.fc2(F.gelu(self._hidden(features.flatten(2))))[..., 0]  # [b, n]

    def _hidden(self, features: Tensor) -> Tensor:
        """W1 f + b1: [b, n, features] -> [b, n, hidden]."""
        return self.fc1(features)

    def budget_threshold(self, budget: float) -> Optional[float]:
        """The probability that (1 - budget) of the held-out chunks stay below (post-hoc training calibrates
        it), or None for a router without calibration (a joint router: its price held it to its budget)."""
        threshold = float(self.calibration[round((1 - budget) * 100)])
        return None if threshold != threshold else threshold
