"""Model configuration: megatron's TransformerConfig plus the multi-mixer fields.

Choices the paper leaves open are fields here (documented in docs/model.md):
the short-conv activation, whether the attention query gets a conv, rotary
embedding in the attention path, the head dims d_k (``kv_channels``) and d_v
(``value_head_dim``), and the MLP width (``ffn_hidden_size``).
"""

from dataclasses import dataclass
from enum import IntEnum
from typing import Optional, Tuple

import torch.nn.functional as F
from megatron.core.transformer import TransformerConfig


class Mode(IntEnum):
    """Values of the ``modes`` tensor [batch, seq]: the mixer each token reads with (room is left
    for more mixers)."""

    LINEAR = 0
    ATTENTION = 1


ATTENTION = "attention"
LINEAR_MIXERS = ("gdn", "mamba2")
KNOWN_MIXERS = (ATTENTION,) + LINEAR_MIXERS
KV_GATES = ("none", "silu", "sigmoid")


@dataclass
class OryxConfig(TransformerConfig):
    """TransformerConfig with the Oryx multi-mixer fields.

    ``num_attention_heads`` is the number of heads H of the block, shared by both
    mixers; ``kv_channels`` is d_k (keys and both queries) and ``value_head_dim`` d_v.
    """

    mixers: str = "attention+gdn"
    """'+'-separated mixers of every layer: 'attention+gdn' (Oryx-TG), 'attention+mamba2'
    (Oryx-TM), or one mixer alone for the single-mixer baselines ('gdn', 'mamba2', 'attention')."""

    value_head_dim: Optional[int] = None
    """d_v; defaults to kv_channels (d_k)."""

    mixer_conv_kernel: int = 4
    """Width of the depthwise causal short convs on K, V and the linear query."""

    mixer_conv_activation: Optional[str] = "silu"
    """Activation after the short convs: 'silu' or None."""

    attention_query_conv: bool = False
    """Give the attention query a short conv too (the paper leaves this open; off = a plain
    Transformer query)."""

    shared_query: bool = False
    """One query for both mixers: the linear query ``act(conv_q(W_Q x))`` is also the attention
    query, as the key is (ablation A1; the paper reports that sharing hurts). Multi-mixer only."""

    kv_gate: str = "none"
    """Multiplicative gates on the shared keys and values, computed from the layer input:
    k_t = act(conv_k(W_K x))_t * gate(W_KG x_t), likewise v; 'none', 'silu' or 'sigmoid'."""

    attention_rotary: bool = True
    """Rotary embedding on the attention query and key (inside the attention path only)."""

    rotary_base: float = 10000.0

    linear_chunk_size: int = 64
    """Chunk length of the chunked linear-recurrence kernels (not the mode chunk)."""

    A_init_range: Tuple[float, float] = (1.0, 16.0)
    dt_min: float = 0.001
    dt_max: float = 0.1
    dt_init_floor: float = 1e-4

    kernel_backend: str = "auto"
    """'auto' (CUDA kernels where present, env ORYX_KERNEL_BACKEND overrides), 'torch' or 'cuda'."""

    router_hidden: Optional[int] = None
    """Width of the chunk router's hidden layer (layers/router.py); None: no router. Multi-mixer only."""

    router_chunk_size: int = 128
    """Tokens per router decision (the training mode chunk by default; a schedule may choose another)."""

    transformer_impl: str = "local"
    """Layer-spec backend: 'local' (megatron tensor_parallel + SDPA) or 'transformer_engine'."""

    def __post_init__(self):
        super().__post_init__()
        if self.value_head_dim is None:
            self.value_head_dim = self.kv_channels
        mixers = self.mixer_list
        unknown = [m for m in mixers if m not in KNOWN_MIXERS]
        if unknown or not mixers or len(set(mixers)) != len(mixers):
            raise ValueError(
                f"mixers={self.mixers!r}: expected distinct mixers from {KNOWN_MIXERS} joined "
                f"by '+', e.g. 'attention+gdn'"
            )
        if sum(m in LINEAR_MIXERS for m in mixers) > 1:
            raise ValueError(f"mixers={self.mixers!r}: at most one linear mixer per layer")
        for name in ("kv_channels", "value_head_dim", "mixer_conv_kernel", "linear_chunk_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be a positive integer")
        if self.mixer_conv_activation not in ("silu", None):
            raise ValueError(
                f"mixer_conv_activation={self.mixer_conv_activation!r}: expected 'silu' or None"
            )
        if self.kv_gate not in KV_GATES:
            raise ValueError(f"kv_gate={self.kv_gate!r}: expected one of {KV_GATES}")
        if self.router_hidden is not None and (self.router_hidden < 1 or not self.is_multi_mixer):
            raise ValueError(f"router_hidden={self.router_hidden}: a router is a positive width and chooses between "
                             f"two mixers, got mixers={self.mixers!r}")
        if self.shared_query and not self.is_multi_mixer:
            raise ValueError(f"shared_query=True needs two mixers to share it, got mixers={self.mixers!r}")
        if self.attention_rotary and self.kv_channels % 2:
            raise ValueError(f"kv_channels={self.kv_channels} must be even for rotary embedding")
        if self.transformer_impl not in ("local", "transformer_engine"):
            raise ValueError(
                f"transformer_impl={self.transformer_impl!r}: expected 'local' or 'transformer_engine'"
            )

    @property
    def mixer_list(self) -> Tuple[str, ...]:
        return tuple(m.strip() for m in self.mixers.split("+") if m.strip())

    @property
    def has_attention(self) -> bool:
        return ATTENTION in self.mixer_list

    @property
    def linear_mixer(self) -> Optional[str]:
        """'gdn', 'mamba2' or None."""
        return next((m for m in self.mixer_list if m in LINEAR_MIXERS), None)

    @property
    def is_multi_mixer(self) -> bool:
        return len(self.mixer_list) > 1


def cpu_friendly_defaults() -> dict:
    """TransformerConfig flags that must be off without CUDA fusions (platform notes, item 7)."""
    return dict(
        use_cpu_initialization=True,
        gradient_accumulation_fusion=False,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
    )


def swiglu_defaults() -> dict:
    """Pre-norm RMSNorm + SwiGLU MLP without biases, the layer the design card assumes."""
    return dict(
        normalization="RMSNorm",
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
