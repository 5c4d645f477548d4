"""Core attention of the Transformer baseline's local spec: torch scaled_dot_product_attention.

megatron's local ``DotProductAttention`` materialises the [b, h, s, s] scores and runs an
unfused softmax over an explicit mask; ``CausalSDPAttention`` computes the same causal
attention with ``F.scaled_dot_product_attention(..., is_causal=True)`` (flash attention on
CUDA, no mask tensor), so the baseline the Oryx layers are compared with is a fair one.

It is built and called exactly as megatron's SelfAttention builds and calls its core attention
(``CoreAttentionBuilder`` / ``CoreAttention`` in megatron/core/transformer/attention.py):
query, key, value [s, b, heads of this TP rank, d] in, [s, b, heads of this TP rank * d] out.
"""

import math
from contextlib import nullcontext
from typing import Optional

import torch.nn.functional as F
from megatron.core import parallel_state, tensor_parallel
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.utils import divide
from torch import Tensor

from oryx_megatron.mixer import ContextParallel


class CausalSDPAttention(MegatronModule):
    """Causal softmax attention over the whole sequence (training, a full forward, megatron's cached decoding).

    The scores are scaled by ``softmax_scale`` (1/sqrt(kv_channels) by default) as megatron's
    DotProductAttention scales them (its ``apply_query_key_layer_scaling`` divides and multiplies
    back by the layer number: the same net scale). Grouped-query keys and values are repeated
    per query head as megatron repeats them. Context parallelism by head all-to-all, as the Oryx mixer's
    (``oryx_megatron.mixer.context_parallel``; megatron's local DotProductAttention has none): this rank's
    tokens of every head in, the whole sequence of this rank's heads attended, back out. Unsupported there and
    here: packed sequences (PackedSeqParams; a document mask as attention_mask is taken), attention bias; not
    offered here: sliding windows and softmax variants.
    """

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: Optional[float] = None,
        softmax_scale: Optional[float] = None,
        cp_comm_type: Optional[str] = None,
        pg_collection: Optional[ProcessGroupCollection] = None,
    ):
        super().__init__(config=config)
        if attn_mask_type != AttnMaskType.causal:
            raise ValueError(f"CausalSDPAttention: attn_mask_type={attn_mask_type}, expected causal")
        if config.window_size is not None or config.softmax_type != "vanilla":
            raise ValueError(
                "CausalSDPAttention supports window_size=None and softmax_type='vanilla', got "
                f"{config.window_size!r}, {config.softmax_type!r}"
            )
        self.cp = ContextParallel(parallel_state.get_context_parallel_group())  # the Oryx mixer's all-to-all
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        tp_size = (
            pg_collection.tp.size()
            if pg_collection is not None
            else parallel_state.get_tensor_model_parallel_world_size()
        )
        self.num_attention_heads_per_partition = divide(config.num_attention_heads, tp_size)
        self.num_query_groups_per_partition = divide(config.num_query_groups, tp_size)
        self.hidden_size_per_partition = divide(config.kv_channels * config.num_attention_heads, tp_size)
        self.softmax_scale = 1.0 / math.sqrt(config.kv_channels) if softmax_scale is None else softmax_scale
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Optional[Tensor],
        attn_mask_type: Optional[AttnMaskType] = None,
        attention_bias: Optional[Tensor] = None,
        packed_seq_params: Optional[PackedSeqParams] = None,
    ) -> Tensor:
        """query [sq, b, np, hn], key and value [sk, b, ng, hn] -> [sq, b, np * hn].
        attention_mask: megatron's [b, 1, sq, sk] bool, True where a query does not read (packed documents,
        or queries after sk - sq cached keys), or None: causal over sq == sk, or one query (a decode step,
        megatron's no_mask) reading every cached key."""
        if attention_bias is not None or packed_seq_params is not None:
            raise ValueError("CausalSDPAttention takes no attention_bias or packed_seq_params")
        mask_type = attn_mask_type or self.attn_mask_type
        sq, sk = query.shape[0], key.shape[0]
        if attention_mask is None and not ((mask_type == AttnMaskType.causal and sq == sk)
                                           or (mask_type == AttnMaskType.no_mask and sq == 1)):
            raise ValueError(f"CausalSDPAttention without a mask reads causally over as many queries as keys, or "
                             f"one query over every key; got attn_mask_type={mask_type}, {sq} queries, {sk} keys")
        repeats = self.num_attention_heads_per_partition // self.num_query_groups_per_partition
        if repeats > 1:
            key = key.repeat_interleave(repeats, dim=2)
            value = value.repeat_interleave(repeats, dim=2)
        # [s / cp, b, np, hn] of this rank's tokens -> [b, np / cp, s, hn]: every token, this rank's heads
        q, k, v = (self.cp.to_heads(t.transpose(0, 1)).transpose(1, 2) for t in (query, key, value))
        dropout_p = self.dropout_p if self.training else 0.0
        forked_rng = dropout_p > 0.0 and not self.config.sequence_parallel  # as DotProductAttention
        with tensor_parallel.get_cuda_rng_tracker().fork() if forked_rng else nullcontext():
            context = F.scaled_dot_product_attention(
                q, k, v, attn_mask=None if attention_mask is None else ~attention_mask, dropout_p=dropout_p,
                is_causal=attention_mask is None and mask_type == AttnMaskType.causal, scale=self.softmax_scale,
            )
        b = query.shape[1]
        context = self.cp.to_sequence(context.transpose(1, 2))  # [b, s / cp, np, hn]
        return context.transpose(0, 1).reshape(sq, b, self.hidden_size_per_partition)
