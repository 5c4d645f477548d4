"""``MultiMixer``: the Oryx mixer (``oryx_megatron.mixer.OryxMixer``) built from megatron's parts, as the spec's
mixer slot. It adds only what megatron asks of a layer part, its construction from a spec and its sharded
checkpoint, and leaves the math to the core, which it overrides nothing of: the fused input projection is a
column-parallel linear from the spec (all-gathering the sequence under sequence parallelism), the output
projection a row-parallel one, the attention the spec's core attention; the per-head parameters (convs,
norm weight, the linear mixer's scalars) hold this rank's heads and checkpoint as shards of the full tensors
along dim 0, so a checkpoint reshards across TP sizes. Under context parallelism the mixing runs on the whole
sequence for a share of the heads (``mixer.context_parallel``): the per-head parameters are replicated over
the context-parallel ranks, as every weight is. Hidden states are [s, b, hidden], megatron's layout.
"""

import logging
from dataclasses import dataclass
from typing import Dict, Union

import torch
from megatron.core import parallel_state
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.utils import (
    ensure_metadata_has_dp_cp_group,
    make_sharded_tensors_for_checkpoint,
    sharded_state_dict_default,
)

from oryx_megatron.layers.config import OryxConfig
from oryx_megatron.layers.hidden_projection import HiddenProjection
from oryx_megatron.mixer import ContextParallel, HeadModule, HeadShard, MixerLayout, OryxMixer

logger = logging.getLogger(__name__)


@dataclass
class MultiMixerSubmodules:
    in_proj: Union[ModuleSpec, type]  # column-parallel fused input projection
    core_attention: Union[ModuleSpec, type]  # q, k, v -> o (bottom-right causal)
    out_proj: Union[ModuleSpec, type]  # row-parallel W_O
    hidden_proj: Union[ModuleSpec, type] = HiddenProjection  # the linear mixer's cross-head features, if it has any


class MultiMixer(OryxMixer):
    """Shared-K/V sequence mixer; input and output hidden states are [s, b, hidden] (sequence-sharded under
    sequence parallelism); ``forward`` returns (out, bias), as the row-parallel ``out_proj`` does."""

    def __init__(self, config: OryxConfig, submodules: MultiMixerSubmodules, layer_number: int = 1):
        tp_group = parallel_state.get_tensor_model_parallel_group()
        heads, layout = config.num_attention_heads, MixerLayout.of(config)
        in_proj = build_module(submodules.in_proj, config.hidden_size, heads * layout.width, config=config,
                               init_method=config.init_method, gather_output=False, bias=False, skip_bias_add=False,
                               is_expert=False, tp_comm_buffer_name="qkv", tp_group=tp_group)
        core_attention = None
        if layout.attention_query is not None:
            core_attention = build_module(submodules.core_attention, config=config, layer_number=layer_number)
        out_proj = build_module(submodules.out_proj, heads * config.value_head_dim, config.hidden_size, config=config,
                                init_method=config.output_layer_init_method, bias=config.add_bias_linear,
                                input_is_parallel=True, skip_bias_add=True, is_expert=False,
                                tp_comm_buffer_name="proj", tp_group=tp_group)
        device = None if config.use_cpu_initialization else torch.cuda.current_device()
        hidden_proj = None
        if layout.hidden_features:  # the linear mixer's cross-head features, replicated over TP
            hidden_proj = build_module(submodules.hidden_proj, config, sum(layout.hidden_features.values()), tp_group,
                                       device)
        cp = ContextParallel(parallel_state.get_context_parallel_group())  # the mixing splits heads, not tokens
        shard = HeadShard(tp_group.size(), tp_group.rank(), config.params_dtype, device, config.perform_initialization,
                          cp)
        super().__init__(config, shard, in_proj, out_proj, core_attention, sequence_first=True,
                         hidden_proj=hidden_proj)
        self.layer_number, self.tp_group = layer_number, tp_group
        self.recompute = config.recompute_granularity == "selective"
        for module in self._head_modules().values():
            for name in module.head_params:
                set_tensor_model_parallel_attributes(getattr(module, name), is_parallel=True, dim=0, stride=1)
        if layer_number == 1:
            logger.info("MultiMixer kernels (%s): %s", config.kernel_backend, self.kernels.names)

    # ---- checkpoints ----
    def _head_modules(self) -> Dict[str, HeadModule]:
        """prefix -> the modules whose own parameters are per head (the convs, the output norm, the linear
        mixer)."""
        return {f"{name}.": module for name, module in self.named_modules()
                if isinstance(module, HeadModule) and module.head_params}

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        """Per-head parameters shard along dim 0 (``mixer.conv_k.weight``, ``mixer.linear_mixer.A_log``, ...);
        the projections and the attention shard as they define."""
        metadata = ensure_metadata_has_dp_cp_group(metadata)
        sharded = {}
        for sub, module in self._head_modules().items():
            own = {sub + name: getattr(module, name) for name in module.head_params}
            sharded.update(make_sharded_tensors_for_checkpoint(
                own, prefix, {name: 0 for name in own}, sharded_offsets,
                tp_group=self.tp_group, dp_cp_group=metadata["dp_cp_group"]))
        for name, module in self.named_children():
            if not isinstance(module, HeadModule):
                sharded.update(sharded_state_dict_default(module, f"{prefix}{name}.", sharded_offsets, metadata,
                                                          tp_group=self.tp_group))
        return sharded

