"""The chunk router: for each chunk of the sequence, the logit that its tokens should read attention.

Causal by construction: the logit of chunk c reads only the chunk's first token and the tokens before it,
through the first layer's two reads of that token (``OryxMixer._chunk_readouts``): per head the attention
read minus the linear read, and the linear read, each normed and gated as the layer's output is:

    f_c     = [y_attn - y_lin, y_lin](t = c * chunk)          [h, 2, d_v], layer 1
    logit_c = w2 . gelu(W1 f_c + b1) + b2

With ``router.layers`` L > 1 it reads the same two reads in each of the first L layers of an all-linear
pass, f_c [h, L, 2, d_v] (``route``): a deeper layer's reads depend on the layers below, and those
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

The routing pass is written here once, for both front ends (``route``, ``route_step``, ``advance_routing``,
``allocate_router_cache``): each hands it its first ``router.layers`` layers, each one a module called as
``layer(hidden, context, cache)`` with an ``input_layernorm`` and a ``mixer`` (an ``OryxMixer``), its router, and
the embedded tokens in its own layout.
"""

import dataclasses
from typing import List, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from oryx_megatron.config import MixerConfig, Mode, RouterConfig
from oryx_megatron.mixer.context import MixerContext, RouterReadouts
from oryx_megatron.mixer.state import MixerCache


# p(attention) from which a chunk reads attention of the router's own accord: the floor of a budget's threshold
# (inference/routing.py) and the share a joint router's price holds to its budget (training/joint_routing.py)
ROUTER_THRESHOLD = 0.5


def router_features(config: MixerConfig, layers: int) -> int:
    """The router's inputs per chunk: per head and routed layer (``layers`` of them), the two reads (d_v each)."""
    return config.num_attention_heads * layers * 2 * config.value_head_dim


class ChunkRouter(nn.Module):
    """features [b, n, h, layers, 2, d_v] (or [b, n, h, 2, d_v] of one layer) -> logits [b, n] (chunks
    0..n-1), the router of ``config``'s mixers that ``router`` describes (its hidden width and layers); ``fc1``: W1
    (default a plain nn.Linear); ``dtype``: of the parameters (None: torch's default)."""

    def __init__(self, config: MixerConfig, router: RouterConfig, dtype: Optional[torch.dtype] = None,
                 fc1: Optional[nn.Module] = None):
        super().__init__()
        hidden = router.hidden
        features = router_features(config, router.layers)
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


class ChunkDecisions:
    """The decisions of a router schedule (``data.schedules.RouterSchedule``: its ``threshold``, ``budget`` and
    ``chunk_size``, else ``chunk_size`` of the router's config) for a batch, chunk after chunk, by ``router``:
    chunk c from its logit and the decisions before it (the budget's quota), never from later logits."""

    def __init__(self, router: Optional[ChunkRouter], schedule, chunk_size: int, batch_size: int, device):
        if router is None:
            raise ValueError(f"schedule '{schedule}' needs a model with a router (router.hidden); "
                             "this one has none")
        self.schedule = schedule
        self.chunk_size = schedule.chunk_size or chunk_size
        self.threshold = schedule.threshold
        if self.threshold is None:  # a budget alone: its calibrated quantile (if any), at least the router's own 0.5
            self.threshold = max(ROUTER_THRESHOLD, router.budget_threshold(schedule.budget) or 0.0)
        self.budget = schedule.budget
        self.used = torch.zeros(batch_size, dtype=torch.long, device=device)  # chunks that read attention
        self.decided = 0  # chunks decided so far

    def __call__(self, logits: Tensor) -> Tensor:
        """The modes [b, k] (int8) of the next k chunks from their logits [b, k]."""
        attend = torch.sigmoid(logits.float()) >= self.threshold  # [b, k]
        modes = []
        for j in range(logits.shape[1]):
            want = attend[:, j]
            if self.budget is not None:
                want = want & (self.used + 1 <= self.budget * (self.decided + 1) + 1)
            self.used += want
            self.decided += 1
            modes.append(torch.where(want, Mode.ATTENTION, Mode.LINEAR))
        return torch.stack(modes, dim=1).to(torch.int8)


def route(layers: Sequence[nn.Module], router: nn.Module, hidden: Tensor, chunk_size: int,
          document_ids: Optional[Tensor] = None, router_cache: Optional[List[MixerCache]] = None) -> Tensor:
    """The router's logits [b, ceil(s / chunk_size)] that chunk c (starting at c * chunk_size) reads attention, from
    the reads of each chunk's first token in ``layers`` (the first ``router.layers``) of an all-linear pass over
    ``hidden`` (the embedded tokens): the first layer's, known before any mode is chosen, and each later one's from
    the layers below read all-linear. ``router_cache`` (``allocate_router_cache``, empty): the pass is a prefill, its
    states left there for ``route_step``."""
    readouts = RouterReadouts(chunk_size)
    linear = dataclasses.replace(_linear_context(layers, document_ids), readouts=readouts)
    for i, layer in enumerate(layers):
        if router_cache is None and i + 1 == len(layers):  # the reads only: the layer's MLP is not needed
            layer.mixer(layer.input_layernorm(hidden), linear)
        else:  # the layer's all-linear forward, which leaves its reads in ``readouts`` on the way
            hidden = layer(hidden, linear, None if router_cache is None else router_cache[i])
    return router(readouts.stacked())  # [b, n, h, layers, 2, d_v]: split with the heads


def route_step(layers: Sequence[nn.Module], router: nn.Module, hidden: Tensor, first_layer_cache: MixerCache,
               router_cache: Optional[List[MixerCache]] = None) -> Tensor:
    """``route`` at decode: the logit [b, 1] of the chunk that starts at the new token (``hidden`` [b, hidden],
    embedded), before that token's step: from the first layer's cache of the model's own pass (``first_layer_cache``,
    left as it was), or, with ``router_cache``, from the all-linear pass's, which the token then advances."""
    readouts = RouterReadouts(1)
    linear = dataclasses.replace(_linear_context(layers), readouts=readouts)
    if router_cache is None:
        first, snapshot = layers[0], first_layer_cache.snapshot()
        try:  # the step writes the token's key and value, which its real step rewrites
            first.mixer.step(first.input_layernorm(hidden), linear, first_layer_cache)
        finally:
            first_layer_cache.restore(snapshot)
    else:  # the all-linear pass's steps, which leave their reads in ``readouts`` on the way
        for layer, cache in zip(layers, router_cache):
            hidden = layer(hidden, linear, cache)
    return router(readouts.stacked())


def advance_routing(layers: Sequence[nn.Module], hidden: Tensor, router_cache: List[MixerCache]) -> None:
    """The all-linear pass of ``router_cache`` over a new token that starts no chunk (``hidden`` [b, hidden],
    embedded)."""
    linear = _linear_context(layers)
    for layer, cache in zip(layers, router_cache):
        hidden = layer(hidden, linear, cache)


def allocate_router_cache(layers: Sequence[nn.Module], batch_size: int, dtype: torch.dtype, device=None,
                          capacity: Optional[int] = None) -> Optional[List[MixerCache]]:
    """The caches of the all-linear pass a router of more than one layer reads (one per routed layer, ``route`` /
    ``route_step`` / ``advance_routing`` keep them); None for a router of the first layer, which reads the model's
    own first-layer cache."""
    if len(layers) == 1:
        return None
    return [layer.mixer.allocate_inference_cache(batch_size, dtype, device, capacity) for layer in layers]


def _linear_context(layers: Sequence[nn.Module], document_ids: Optional[Tensor] = None) -> MixerContext:
    """Every token reading linear; a router reads both mixers (a single-mixer model has no router)."""
    config = layers[0].mixer.config
    if not config.is_multi_mixer:
        raise ValueError(f"a router reads both mixers: mixers={config.mixers!r} has one")
    return MixerContext.build(config, Mode.LINEAR, document_ids)
