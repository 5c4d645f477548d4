"""Builders shared by the tests."""

import dataclasses

import torch

from oryx_megatron.config import ModelArgs
from oryx_megatron.layers.multi_mixer import MultiMixer
from oryx_megatron.mixer import MixerContext
from oryx_megatron.models.builder import transformer_config
from oryx_megatron.models.specs import get_oryx_layer_local_spec


def tiny_args(family="oryx_tg", **overrides) -> ModelArgs:
    fields = dict(
        family=family, num_layers=2, hidden_size=64, num_attention_heads=4, kv_channels=16,
        ffn_hidden_size=128, vocab_size=97, max_sequence_length=128, linear_chunk_size=8,
        kernel_backend="torch",
    )
    fields.update(overrides)
    return ModelArgs(**fields)


def build_mixer(family="oryx_tg", seed=0, dtype=torch.float64, parallel=None, mixers=None, **overrides) -> MultiMixer:
    """A MultiMixer of a tiny recipe; `mixers` overrides the family's mixer list (family "oryx": gives it)."""
    recipe = tiny_args(family, **overrides, **({"mixers": mixers} if family == "oryx" else {}))
    config = transformer_config(recipe, params_dtype=dtype, **(parallel or {}))
    if mixers is not None:
        config = dataclasses.replace(config, mixers=mixers)
    torch.manual_seed(seed)
    spec = get_oryx_layer_local_spec().submodules.mixer
    return MultiMixer(config, spec.submodules).to(dtype)


def mix(mixer, x, modes, cache=None, document_ids=None):
    """The mixer's output [s, b, hidden] for x [s, b, hidden] and modes as the model hands them down (one
    ``MixerContext``); with ``cache`` a prefill, or a decode step for one token after cached ones."""
    if torch.is_tensor(modes) and modes.dim() == 1:  # one token per sequence: [b] -> [b, 1]
        modes = modes[:, None]
    decode = cache is not None and cache.seqlen > 0 and x.shape[0] == 1
    return mixer(x, MixerContext.build(mixer.config, modes, document_ids, decode=decode), cache)[0]
