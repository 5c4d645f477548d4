"""The Oryx mixer, written once in plain torch (no megatron, no transformers): the projection layout, the K/V
gate, short convs, rotary, both mixers' parallel forward and decode step, readout selection, the per-layer
inference state and the chunk router. The megatron layer (``oryx_megatron.layers``) and the Hugging Face
model (``oryx_megatron.hf``) hold its parameters and call it.

- ``OryxMixer`` (oryx_mixer.py) and its ``MixerLayout``; ``linear``: the linear mixers (``LINEAR_MIXERS``);
- ``MixerContext``: what every layer of one forward shares (modes, reads, documents, router weights), and
  ``RouterReadouts``, where the layers leave the router's features;
- ``MixerCache``: one layer's inference state; ``router``: the ``ChunkRouter`` and the routing pass both front
  ends call (``route``, ``route_step``, ``advance_routing``, ``allocate_router_cache``).
"""

from oryx_megatron.mixer.context import QUERY_BLOCK, MixerContext, RouterReadouts
from oryx_megatron.mixer.context_parallel import ContextParallel
from oryx_megatron.mixer.heads import HeadModule, HeadShard
from oryx_megatron.mixer.layout import MixerLayout
from oryx_megatron.mixer.linear import LINEAR_MIXERS, LinearMixer, linear_mixer_class, linear_mixers
from oryx_megatron.mixer.oryx_mixer import OryxMixer
from oryx_megatron.mixer.router import ChunkRouter
from oryx_megatron.mixer.state import KV_BLOCK, MixerCache, MixerSnapshot

__all__ = ["ChunkRouter", "ContextParallel", "HeadModule", "HeadShard", "KV_BLOCK", "LINEAR_MIXERS", "LinearMixer",
           "MixerCache", "MixerContext", "MixerLayout", "MixerSnapshot", "OryxMixer", "QUERY_BLOCK", "RouterReadouts",
           "linear_mixer_class", "linear_mixers", "router"]
