"""OryxModel: embedding -> decoder (N Oryx layers, final norm) -> output layer, a megatron
LanguageModule laid out like GPTModel.

The per-token ``modes`` [b, s] (or one ``Mode`` read by every token) enter ``forward`` with the batch; the
model turns them, the packed documents and the router's weights into one ``MixerContext`` per forward, which
every layer receives (the same modes apply to every layer for a token). Pipeline stages build only their
layers (``pre_process``/``post_process`` as in megatron's GPTModel).
"""

from functools import partial
from typing import List, Optional

import torch
from megatron.core import parallel_state, tensor_parallel
from megatron.core.dist_checkpointing.utils import replace_prefix_for_sharding
from megatron.core.enums import ModelType
from megatron.core.models.common.language_module.language_module import LanguageModule
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.transformer_block import get_num_layers_to_build
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset
from megatron.core.transformer.utils import (
    ensure_metadata_has_dp_cp_group,
    sharded_state_dict_default,
)
from torch import Tensor

from oryx_megatron.layers.config import OryxConfig
from oryx_megatron.layers.embedding import TokenEmbedding
from oryx_megatron.layers.linear import ColumnLinear
from oryx_megatron.layers.router import ParallelChunkRouter
from oryx_megatron.models.layer_init import layer_init_rng
from oryx_megatron.mixer import MixerCache, MixerContext
from oryx_megatron.mixer import router as routing


def _build_layer(layer_spec: ModuleSpec, config: OryxConfig, layer_number: int):
    """A layer with its own mixers (``model.layer_pattern``: ``config.layer_config``) whose initial weights depend
    only on the seed and its global number (``layer_init_rng``)."""
    with layer_init_rng(layer_number):
        return build_module(layer_spec, config=config.layer_config(layer_number - 1), layer_number=layer_number)


class OryxBlock(MegatronModule):
    """The layers of this pipeline stage, and the final norm on the last stage. Under a layer pattern each layer
    reads the forward's context as its mixers do (``MixerContext.read_by``: an Oryx block the tokens' modes, a
    single-mixer layer its one mixer), derived once per forward for each kind of layer."""

    def __init__(
        self,
        config: OryxConfig,
        layer_spec: ModuleSpec,
        post_process: bool = True,
        vp_stage: Optional[int] = None,
    ):
        super().__init__(config)
        self.tp_group = parallel_state.get_tensor_model_parallel_group()
        offset = get_transformer_layer_offset(config, vp_stage)
        self.layers = torch.nn.ModuleList(
            _build_layer(layer_spec, config, layer_number=offset + i + 1)
            for i in range(get_num_layers_to_build(config, vp_stage))
        )
        self.layer_configs = [layer.mixer.config for layer in self.layers]
        self.final_layernorm = None
        if post_process:
            self.final_layernorm = build_module(
                layer_spec.submodules.input_layernorm,
                config=config,
                hidden_size=config.hidden_size,
                eps=config.layernorm_epsilon,
            )

    def forward(self, hidden_states: Tensor, context: MixerContext,
                inference_cache: Optional[List[MixerCache]] = None) -> Tensor:
        recompute = self.config.recompute_granularity == "full" and self.training
        for i, (layer, layer_context) in enumerate(zip(self.layers, context.for_layers(self.layer_configs))):
            if inference_cache is not None:
                hidden_states = layer(hidden_states, layer_context, inference_cache[i])
            elif recompute:  # keep only the layer's input; redo its forward in the backward
                hidden_states = tensor_parallel.checkpoint(partial(layer, context=layer_context), False,
                                                           hidden_states)
            else:
                hidden_states = layer(hidden_states, layer_context)
        if self.final_layernorm is not None:
            hidden_states = self.final_layernorm(hidden_states)
        return hidden_states

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        """Layers are keyed in the checkpoint by their global number, so checkpoints reshard across PP
        stages; the dict keeps the module's own (local) names, which ``load_state_dict`` expects."""
        metadata = ensure_metadata_has_dp_cp_group(metadata)
        sharded = {}
        for i, layer in enumerate(self.layers):
            local_prefix = f"{prefix}layers.{i}."
            layer_sharded = layer.sharded_state_dict(local_prefix, sharded_offsets, metadata)
            replace_prefix_for_sharding(layer_sharded, local_prefix, f"{prefix}layers.{layer.layer_number - 1}.")
            sharded.update(layer_sharded)
        if self.final_layernorm is not None:
            sharded.update(
                sharded_state_dict_default(
                    self.final_layernorm, f"{prefix}final_layernorm.", sharded_offsets, metadata,
                    tp_group=self.tp_group,
                )
            )
        return sharded


class OryxModel(LanguageModule):
    def __init__(
        self,
        config: OryxConfig,
        layer_spec: ModuleSpec,
        vocab_size: int,
        max_sequence_length: int,
        pre_process: bool = True,
        post_process: bool = True,
        share_embeddings_and_output_weights: bool = True,
        parallel_output: bool = True,
        vp_stage: Optional[int] = None,
    ):
        super().__init__(config)
        self.model_type = ModelType.encoder_or_decoder  # read by megatron's pipeline schedules
        self.vocab_size = vocab_size
        self.max_sequence_length = max_sequence_length
        self.pre_process, self.post_process = pre_process, post_process
        self.share_embeddings_and_output_weights = share_embeddings_and_output_weights
        self.parallel_output = parallel_output
        self.input_tensor = None  # activations from the previous pipeline stage
        self.vp_stage = vp_stage

        if pre_process:
            self.embedding = TokenEmbedding(
                config, vocab_size, max_sequence_length, position_embedding_type="none",
                tp_group=self.tp_group,
            )
        self.decoder = OryxBlock(config, layer_spec, post_process, vp_stage)
        if post_process:
            self.output_layer = ColumnLinear(
                config.hidden_size,
                vocab_size,
                config=config,
                init_method=config.init_method,
                bias=False,
                skip_bias_add=False,
                gather_output=not parallel_output,
                skip_weight_param_allocation=pre_process and share_embeddings_and_output_weights,
                tp_group=self.tp_group,
            )
        self.router = ParallelChunkRouter(config) if pre_process and config.router.hidden else None
        if pre_process or post_process:
            self.setup_embeddings_and_output_layer()

    def set_input_tensor(self, input_tensor) -> None:
        """Megatron's pipeline schedules hand a stage its input here."""
        self.input_tensor = input_tensor[0] if isinstance(input_tensor, list) else input_tensor

    def forward(
        self,
        input_ids: Tensor,
        modes: Optional[Tensor] = None,
        labels: Optional[Tensor] = None,
        inference_cache: Optional[List[MixerCache]] = None,
        last_token_logits: bool = False,
        document_ids: Optional[Tensor] = None,
        router_weights: Optional[Tensor] = None,
    ) -> Tensor:
        """input_ids, modes, labels, document_ids: [b, s]. Returns the loss [b, s] given labels, else
        logits [b, s, vocab] (vocab-parallel unless parallel_output=False; [b, 1, vocab] of the last
        position only with ``last_token_logits``, as a prefill needs); a middle pipeline stage returns
        hidden states [s, b, hidden]. ``document_ids`` (packed documents, data.reset_at_eod): each
        document is read as if alone. ``router_weights`` [b, s] (joint routing) instead of modes: each token
        reads linear + w (attention - linear), w 0/1 in value with a gradient to the router."""
        decode = inference_cache is not None and input_ids.shape[1] == 1 and inference_cache[0].seqlen > 0
        context = MixerContext.build(self.config, modes, document_ids, router_weights, decode)
        hidden = self.embedding(input_ids, position_ids=None) if self.pre_process else self.input_tensor
        if decode:  # one token per sequence: the layers step on [b, hidden]
            hidden = self.decoder(hidden[0], context, inference_cache)[None]
        else:
            hidden = self.decoder(hidden, context, inference_cache)
        if not self.post_process:
            return hidden
        if last_token_logits and labels is None and not self.config.sequence_parallel:
            hidden = hidden[-1:]  # [1, b, hidden]: no [s, b, vocab] logits for a long prompt
        weight = self.shared_embedding_or_output_weight() if self.share_embeddings_and_output_weights else None
        logits, _ = self.output_layer(hidden, weight=weight)  # [s, b, vocab / tp]
        if labels is None:
            return logits.transpose(0, 1).contiguous()
        return self.compute_language_model_loss(labels, logits)

    # ---- the routing pass (mixer/router.py), over this stage's first router.layers layers ----
    def route(self, input_ids: Tensor, chunk_size: int, document_ids: Optional[Tensor] = None,
              router_cache: Optional[List[MixerCache]] = None) -> Tensor:
        """The router's logits [b, ceil(s / chunk_size)] (``mixer.router.route``)."""
        return routing.route(self._routed_layers(), self.router, self.embedding(input_ids, position_ids=None),
                             chunk_size, document_ids, router_cache)

    def route_step(self, input_ids: Tensor, inference_cache: List[MixerCache],
                   router_cache: Optional[List[MixerCache]] = None) -> Tensor:
        """The logit [b, 1] of the chunk that starts at input_ids [b, 1] (``mixer.router.route_step``)."""
        return routing.route_step(self._routed_layers(), self.router, self.embedding(input_ids, position_ids=None)[0],
                                  inference_cache[0], router_cache)

    def advance_router(self, input_ids: Tensor, router_cache: List[MixerCache]) -> None:
        """``mixer.router.advance_routing`` over input_ids [b, 1]."""
        routing.advance_routing(self._routed_layers(), self.embedding(input_ids, position_ids=None)[0], router_cache)

    def allocate_router_cache(self, batch_size: int, dtype: torch.dtype, device=None,
                              capacity: Optional[int] = None) -> Optional[List[MixerCache]]:
        """``mixer.router.allocate_router_cache`` of this model's routed layers."""
        return routing.allocate_router_cache(self._routed_layers(), batch_size, dtype, device, capacity)

    def _routed_layers(self):
        if self.router is None:
            raise ValueError("this model has no router (router.hidden is null)")
        layers = self.decoder.layers[: self.config.router.layers]
        if len(layers) < self.config.router.layers:
            raise ValueError(f"router.layers={self.config.router.layers}: this pipeline stage holds "
                             f"{len(self.decoder.layers)} layers; the router reads its first stage only")
        return layers

    def allocate_inference_cache(self, batch_size: int, dtype: torch.dtype, device=None,
                                 capacity: Optional[int] = None, kv_cache: bool = True) -> List[MixerCache]:
        """One empty cache per layer of this stage (``MultiMixer.allocate_inference_cache``)."""
        return [
            layer.mixer.allocate_inference_cache(batch_size, dtype, device, capacity, kv_cache)
            for layer in self.decoder.layers
        ]
