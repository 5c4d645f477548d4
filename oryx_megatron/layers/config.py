"""Megatron's model config: ``OryxConfig`` is TransformerConfig plus the Oryx mixer's fields, which
``oryx_megatron.config.MixerConfig`` declares and checks (once, for every front end), and the model's router
(``oryx_megatron.config.RouterConfig``)."""

from dataclasses import dataclass, field

import torch.nn.functional as F
from megatron.core.transformer import TransformerConfig

from oryx_megatron.config import MixerConfig, RouterConfig
from oryx_megatron.mixer import linear_mixer_class

TRANSFORMER_IMPLS = ("local", "transformer_engine")


@dataclass
class OryxConfig(TransformerConfig, MixerConfig):
    """TransformerConfig with MixerConfig's fields (``num_attention_heads``, ``kv_channels``, ``hidden_size`` and
    ``layernorm_epsilon`` are TransformerConfig's own and keep its meaning)."""

    transformer_impl: str = "local"
    """Layer-spec backend: 'local' (megatron tensor_parallel + SDPA) or 'transformer_engine'."""

    router: RouterConfig = field(default_factory=RouterConfig)
    """The model's chunk router (``router.hidden`` None: none); its architecture is what the model reads."""

    def __post_init__(self):
        TransformerConfig.__post_init__(self)
        self.check_mixer_fields()
        self.check_pattern_length(self.num_layers)
        linear_mixer_class(self)  # a registered linear mixer
        if self.transformer_impl not in TRANSFORMER_IMPLS:
            raise ValueError(f"transformer_impl={self.transformer_impl!r}: expected one of {TRANSFORMER_IMPLS}")


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
    """Pre-norm RMSNorm + SwiGLU MLP without biases, the layer docs/design.md assumes."""
    return dict(
        normalization="RMSNorm",
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
