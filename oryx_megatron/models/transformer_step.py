"""The Transformer baseline's cached forward, megatron's layers read directly.

megatron's cached forward goes through GPTModel's inference preamble (rotary table of the whole capacity,
``_adjust_key_value_for_inference``, the inference context's bookkeeping), every layer's TransformerLayer /
SelfAttention / MLP forward and their argument plumbing: at a tiny model that costs several times the arithmetic.
``cached_step`` computes the same thing from the same parameters into megatron's KV buffers (its static inference
context, ``TransformerCache``), for s new tokens after t cached ones, per layer:

    x = norm(h);  q, k, v = split(W_qkv x)  (megatron's grouped layout [ng, (np/ng + 2) hn])
    q, k = rope(q, k at positions t .. t+s-1);  K[t : t+s], V[t : t+s] = k, v
    h = h + W_o SDPA(q, K[: t+s], V[: t+s], mask);  h = h + W_2 act_glu(W_1 norm(h))

then the final norm and the output layer. The buffers keep keys rotated, each rotated once when written
(megatron's own forward keeps them unrotated and rotates all of them at every step), so a cache that this step
writes is read by this step only: ``TransformerBaseline`` sends every cached call of a model it ``supports`` here,
prefill included. It reads the same megatron functions for the rotary angles and the rotate-half, so the logits
are megatron's (tests/test_generation.py compares cached decoding with a parallel recompute). ``supports`` says
whether a model is one it computes (the local spec at TP=1, no q/k norm, no MoE, no output gate, pre-norm
residuals, no weight megatron rematerialises); any other decodes through megatron's own forward.
"""

from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from megatron.core.models.common.embeddings.rope_utils import _rotate_half
from megatron.core.transformer.identity_op import IdentityOp
from torch import Tensor

from oryx_megatron.layers.gpt_attention import CausalSDPAttention
from oryx_megatron.layers.linear import rematerialised


def supports(model) -> bool:
    """Whether ``cached_step`` computes ``model`` (a TransformerBaseline) exactly as megatron's forward does."""
    config = model.config
    if (config.tensor_model_parallel_size != 1 or config.num_moe_experts is not None or config.fp32_residual_connection
            or config.apply_residual_connection_post_layernorm or config.multi_latent_attention
            or config.rotary_interleaved or getattr(config, "attention_output_gate", False)
            or getattr(model, "rotary_pos_emb", None) is None or any(map(rematerialised, model.modules()))):
        return False
    for layer in model.decoder.layers:
        attention = layer.self_attention
        if not isinstance(attention.core_attention, CausalSDPAttention) or not all(
                norm is None or isinstance(norm, IdentityOp) for norm in (attention.q_layernorm, attention.k_layernorm)):
            return False
    return True


def rotary_tables(model, capacity: int, dtype: torch.dtype) -> Tuple[Tensor, Tensor]:
    """cos, sin [capacity, 1, 1, d] of megatron's rotary angles (``RotaryEmbedding``), in ``dtype``."""
    freqs = model.rotary_pos_emb(capacity)  # [capacity, 1, 1, d] fp32
    return torch.cos(freqs).to(dtype), torch.sin(freqs).to(dtype)


def _rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    return x * cos + _rotate_half(x, False) * sin  # megatron's _apply_rotary_pos_emb_bshd (mscale 1)


def _linear(module, x: Tensor) -> Tensor:
    return F.linear(x, module.weight, module.bias)


def cached_step(model, input_ids: Tensor, cache, mask: Optional[Tensor], last_token_logits: bool) -> Tensor:
    """input_ids [b, s] after ``cache.seqlen`` cached tokens (room reserved), ``mask`` [b, 1, s, t + s] (True: not
    read; None: causal from an empty cache, or one token reading every cached one) -> logits [b, s, V] ([b, 1, V]
    with ``last_token_logits``); writes the tokens' rotated keys and values and advances the cache."""
    t, s = cache.seqlen, input_ids.shape[1]
    cos, sin = cache.rotary(model)
    cos, sin = cos[t : t + s], sin[t : t + s]  # [s, 1, 1, d]
    read = None if mask is None else ~mask  # SDPA's boolean mask: True reads
    hidden = model.embedding(input_ids, position_ids=None)  # [s, b, hidden]
    buffers = cache.context.key_value_memory_dict
    for layer in model.decoder.layers:
        attention = layer.self_attention
        groups, d = attention.num_query_groups_per_partition, attention.hidden_size_per_attention_head
        heads = attention.num_attention_heads_per_partition
        qkv = _linear(attention.linear_qkv, layer.input_layernorm(hidden))  # [s, b, ng (np/ng + 2) d]
        qkv = qkv.view(s, -1, groups, (heads // groups + 2) * d)
        q, k, v = qkv.split([heads // groups * d, d, d], dim=3)
        q = _rope(q.reshape(s, -1, heads, d), cos, sin)  # [s, b, np, d]
        keys, values = buffers[attention.layer_number]  # [capacity, b, ng, d]
        keys[t : t + s], values[t : t + s] = _rope(k, cos, sin), v
        k, v = keys[: t + s], values[: t + s]
        if heads > groups:
            k, v = k.repeat_interleave(heads // groups, dim=2), v.repeat_interleave(heads // groups, dim=2)
        o = F.scaled_dot_product_attention(q.permute(1, 2, 0, 3), k.permute(1, 2, 0, 3), v.permute(1, 2, 0, 3),
                                           attn_mask=read, is_causal=mask is None and s > 1,
                                           scale=attention.core_attention.softmax_scale)  # [b, np, s, d]
        hidden = hidden + _linear(attention.linear_proj, o.permute(2, 0, 1, 3).reshape(s, -1, heads * d))
        mlp = layer.mlp
        y = _linear(mlp.linear_fc1, layer.pre_mlp_layernorm(hidden))
        if mlp.config.gated_linear_unit:
            gate, up = torch.chunk(y, 2, dim=-1)
            y = mlp.config.activation_func(gate) * up
        else:
            y = mlp.config.activation_func(y)
        hidden = hidden + _linear(mlp.linear_fc2, y)
    if last_token_logits:
        hidden = hidden[-1:]
    hidden = model.decoder.final_layernorm(hidden)
    weight = model.shared_embedding_or_output_weight() if model.share_embeddings_and_output_weights \
        else model.output_layer.weight
    cache.advance(s, mask)
    return F.linear(hidden, weight).transpose(0, 1)  # [b, s or 1, V]
