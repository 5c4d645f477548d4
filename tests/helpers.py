"""Builders shared by the tests."""

import dataclasses

import torch

from oryx_megatron.config import ModelArgs
from oryx_megatron.models.builder import transformer_config
from oryx_megatron.models.specs import get_oryx_layer_local_spec
from oryx_megatron.layers.multi_mixer import MultiMixer


def tiny_args(family="oryx_tg", **overrides) -> ModelArgs:
    fields = dict(
        family=family, num_layers=2, hidden_size=64, num_attention_heads=4, kv_channels=16,
        ffn_hidden_size=128, vocab_size=97, max_sequence_length=128, linear_chunk_size=8,
        kernel_backend="torch",
    )
    fields.update(overrides)
    return ModelArgs(**fields)


def build_mixer(family="oryx_tg", seed=0, dtype=torch.float64, parallel=None, mixers=None, **overrides) -> MultiMixer:
    """A MultiMixer of a tiny recipe; `mixers` overrides the family's mixer list."""
    config = transformer_config(tiny_args(family, **overrides), params_dtype=dtype, **(parallel or {}))
    if mixers is not None:
        config = dataclasses.replace(config, mixers=mixers)
    torch.manual_seed(seed)
    spec = get_oryx_layer_local_spec().submodules.mixer
    return MultiMixer(config, spec.submodules).to(dtype)
