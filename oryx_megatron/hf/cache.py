"""``OryxCache``: the inference state of an ``OryxForCausalLM``, passed as ``past_key_values`` (``cache``).

One ``oryx_megatron.mixer.MixerCache`` per layer (conv states, KV cache, recurrent state and document
bookkeeping, updated in place on every token whatever its mode: the same states as megatron's inference),
plus what transformers' ``generate`` asks of a cache, the last token fed (a model trained with
``data.reset_at_eod`` restarts every state after an EOD token) and, under a router schedule, the routing's
progress (``RoutingState``).
"""

from dataclasses import dataclass
from typing import List, Optional

import torch
from torch import Tensor

from oryx_megatron.mixer import MixerCache
from oryx_megatron.mixer.router import ChunkDecisions


@dataclass
class RoutingState:
    """A router schedule's progress over a cache: its decisions so far, the modes of the chunks decided, and the
    all-linear pass that a router of more than one layer reads (``mixer.router.allocate_router_cache``)."""

    decisions: ChunkDecisions
    router_cache: Optional[List[MixerCache]]
    chunk_modes: Optional[Tensor] = None  # [b, chunks decided] int8

    def decide(self, logits: Tensor) -> None:
        """The next chunks' modes from their router logits [b, k]."""
        modes = self.decisions(logits)
        self.chunk_modes = modes if self.chunk_modes is None else torch.cat([self.chunk_modes, modes], dim=1)

    def modes(self, start: int, end: int) -> Tensor:
        """The modes [b, end - start] of positions [start, end) (decided)."""
        return self.chunk_modes.repeat_interleave(self.decisions.chunk_size, dim=1)[:, start:end].long()


class OryxCache:
    """Everything an Oryx model remembers of the tokens it was fed; made by ``OryxForCausalLM.allocate_cache``
    (``kv_cache=False`` keeps no keys and values: linear-only inference, a token reading attention is refused)."""

    def __init__(self, layers: List[MixerCache], routing: Optional[RoutingState] = None):
        self.layers = layers
        self.routing = routing
        self.last_tokens: Optional[Tensor] = None  # [b]

    @property
    def seqlen(self) -> int:
        """Tokens held."""
        return self.layers[0].seqlen

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Tokens held (transformers' generate slices a prompt continuing the cache by it)."""
        return self.seqlen

    @property
    def is_linear(self) -> List[bool]:
        """Per layer, whether transformers' generate should skip slicing by ``get_seq_length``: never, every
        layer counts every token it absorbed."""
        return [False] * len(self.layers)

    def start_documents(self, starting: Tensor) -> None:
        """The next token of the sequences where ``starting`` [b] bool starts a document: every layer's conv and
        recurrent states restart from zero and attention reads from here on (the routing's all-linear pass too)."""
        routed = [] if self.routing is None else self.routing.router_cache or []
        for layer in self.layers + routed:
            layer.start_documents(starting)
