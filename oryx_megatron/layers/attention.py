"""Core (softmax) attention modules for the layer specs: q, k, v in, output out.

Both take q [b, sq, h, d_k], k [b, sk, h, d_k], v [b, sk, h, d_v] with the queries
at the last sq positions (bottom-right causal), which serves training (sq == sk) and
prefill after a cached prefix alike; and ``read`` [b, sq] bool, the positions whose output
is used (None: all of them); and ``document_ids`` [b, sk] (None: one document), within which a
query reads.
"""

from typing import Optional

from megatron.core.transformer.module import MegatronModule
from torch import Tensor

from oryx_megatron.config import OryxConfig
from oryx_megatron.ops import get_kernels


class SDPAttention(MegatronModule):
    """Local backend: torch scaled_dot_product_attention (flash on CUDA, math on CPU); with ``read``,
    only the query blocks holding a reading position (FlexAttention on CUDA)."""

    query_block = 128  # positions per query block of the block-sparse read (FlexAttention's default)

    def __init__(self, config: OryxConfig, layer_number: int = 1):
        super().__init__(config)
        self.kernels = get_kernels(config.kernel_backend)

    def forward(self, q: Tensor, k: Tensor, v: Tensor, read: Optional[Tensor] = None,
                document_ids: Optional[Tensor] = None) -> Tensor:
        if read is None:
            return self.kernels.causal_attention(q, k, v, document_ids=document_ids)
        return self.kernels.block_sparse_causal_attention(q, k, v, read, self.query_block, document_ids=document_ids)


class TEAttention(MegatronModule):
    """Transformer Engine backend: ``transformer_engine.pytorch.DotProductAttention`` (dense: it
    computes every position whatever ``read`` says)."""

    def __init__(self, config: OryxConfig, layer_number: int = 1):
        super().__init__(config)
        import transformer_engine.pytorch as te
        from megatron.core import parallel_state

        tp = parallel_state.get_tensor_model_parallel_world_size()
        self.attention = te.DotProductAttention(
            num_attention_heads=config.num_attention_heads // tp,
            kv_channels=(config.kv_channels, config.value_head_dim),
            attention_dropout=config.attention_dropout,
            qkv_format="bshd",
            attn_mask_type="causal_bottom_right",
            layer_number=layer_number,
        )

    def forward(self, q: Tensor, k: Tensor, v: Tensor, read: Optional[Tensor] = None,
                document_ids: Optional[Tensor] = None) -> Tensor:
        if document_ids is not None:
            raise NotImplementedError("transformer_impl=transformer_engine does not take packed documents "
                                      "(data.reset_at_eod) yet: use transformer_impl=local")
        b, sq, h, _ = q.shape
        return self.attention(q, k, v).view(b, sq, h, -1)  # TE returns [b, sq, h * d_v]
