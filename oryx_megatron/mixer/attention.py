"""The core (softmax) attention of the Oryx mixer: q, k, v in, output out (a module slot: megatron's
Transformer Engine spec puts TE's attention here, layers/attention.py).

q [b, sq, h, d_k], k [b, sk, h, d_k], v [b, sk, h, d_v] with the queries at the last sq positions
(bottom-right causal: training, sq == sk, and prefill after a cached prefix alike); ``reads``, the
block-sparse read of the forward (``ops.BlockReads``; None: every position); ``document_ids`` [b, sk] (None:
one document), within which a query reads.
"""

from typing import Optional

from torch import Tensor, nn

from oryx_megatron.config import MixerConfig
from oryx_megatron.ops import BlockReads, get_kernels


class SDPAttention(nn.Module):
    """torch's scaled_dot_product_attention (flash on CUDA, math on CPU); with ``reads``, only the query
    blocks holding a reading position (FlexAttention on CUDA)."""

    def __init__(self, config: MixerConfig, layer_number: int = 1):
        super().__init__()
        self.kernels = get_kernels(config.kernel_backend)

    def forward(self, q: Tensor, k: Tensor, v: Tensor, reads: Optional[BlockReads] = None,
                document_ids: Optional[Tensor] = None) -> Tensor:
        if reads is None:
            return self.kernels.causal_attention(q, k, v, document_ids=document_ids)
        return self.kernels.block_sparse_causal_attention(q, k, v, reads, document_ids=document_ids)
