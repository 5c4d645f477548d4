"""Transformer Engine's attention in the Oryx mixer's attention slot (the ``transformer_engine`` spec; the local
spec takes the mixer core's ``SDPAttention``). Same call as ``oryx_megatron.mixer.attention``."""

from typing import Optional

from megatron.core.transformer.module import MegatronModule
from torch import Tensor

from oryx_megatron.layers.config import OryxConfig
from oryx_megatron.ops import BlockReads


class TEAttention(MegatronModule):
    """``transformer_engine.pytorch.DotProductAttention`` (dense: it computes every position whatever ``reads``
    says)."""

    def __init__(self, config: OryxConfig, layer_number: int = 1):
        super().__init__(config)
        import transformer_engine.pytorch as te
        from megatron.core import parallel_state

        tp, cp = (parallel_state.get_tensor_model_parallel_world_size(),
                  parallel_state.get_context_parallel_world_size())
        self.attention = te.DotProductAttention(  # the whole sequence of this rank's heads (mixer.context_parallel)
            num_attention_heads=config.num_attention_heads // (tp * cp),
            kv_channels=(config.kv_channels, config.value_head_dim),
            attention_dropout=config.attention_dropout,
            qkv_format="bshd",
            attn_mask_type="causal_bottom_right",
            layer_number=layer_number,
        )

    def forward(self, q: Tensor, k: Tensor, v: Tensor, reads: Optional[BlockReads] = None,
                document_ids: Optional[Tensor] = None) -> Tensor:
        if document_ids is not None:
            raise NotImplementedError("transformer_impl=transformer_engine does not take packed documents "
                                      "(data.reset_at_eod) yet: use transformer_impl=local")
        b, sq, h, _ = q.shape
        return self.attention(q, k, v).view(b, sq, h, -1)  # TE returns [b, sq, h * d_v]
