"""One pre-norm Oryx layer: h = h + MultiMixer(norm(h), context); h = h + MLP(norm(h))."""

from dataclasses import dataclass
from typing import Optional, Union

import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from torch import Tensor

from oryx_megatron.layers.config import OryxConfig
from oryx_megatron.mixer import MixerCache, MixerContext


@dataclass
class OryxLayerSubmodules:
    input_layernorm: Union[ModuleSpec, type]
    mixer: Union[ModuleSpec, type]
    pre_mlp_layernorm: Union[ModuleSpec, type]
    mlp: Union[ModuleSpec, type]


class OryxLayer(MegatronModule):
    """Hidden states are [s, b, hidden] (sequence-sharded under sequence parallelism)."""

    def __init__(self, config: OryxConfig, submodules: OryxLayerSubmodules, layer_number: int = 1):
        super().__init__(config)
        self.layer_number = layer_number
        norm_args = dict(config=config, hidden_size=config.hidden_size, eps=config.layernorm_epsilon)
        self.input_layernorm = build_module(submodules.input_layernorm, **norm_args)
        self.mixer = build_module(submodules.mixer, config=config, layer_number=layer_number)
        self.pre_mlp_layernorm = build_module(submodules.pre_mlp_layernorm, **norm_args)
        self.mlp = build_module(
            submodules.mlp,
            config=config,
            ffn_hidden_size=config.ffn_hidden_size,
            tp_group=parallel_state.get_tensor_model_parallel_group(),
        )

    def forward(self, hidden_states: Tensor, context: MixerContext,
                inference_cache: Optional[MixerCache] = None) -> Tensor:
        """hidden_states [s, b, hidden], or [b, hidden] at a decode step (``OryxMixer.step``); ``context``: the
        forward's modes, reads and documents (``MixerContext``)."""
        out, bias = self.mixer(self.input_layernorm(hidden_states), context, inference_cache)
        hidden_states = hidden_states + self._dropout(out, bias)
        out, bias = self.mlp(self.pre_mlp_layernorm(hidden_states))
        return hidden_states + self._dropout(out, bias)

    def _dropout(self, out: Tensor, bias: Optional[Tensor]) -> Tensor:
        if bias is not None:
            out = out + bias
        if not self.training or self.config.hidden_dropout == 0.0:  # a decode step: no dispatched no-op
            return out
        return F.dropout(out, p=self.config.hidden_dropout, training=True)
