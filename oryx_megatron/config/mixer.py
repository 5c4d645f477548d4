"""The Oryx mixer's hyperparameters, declared once (``MixerConfig``), and the vocabulary of the ``modes`` tensor.

Every front end derives its config from ``MixerConfig`` by one mapping: megatron's ``OryxConfig``
(layers/config.py) inherits these fields beside TransformerConfig's, the recipe schema ``ModelArgs``
(config/model.py) inherits them beside the model's shape, and the Hugging Face ``OryxHFConfig`` renames
them (``hf.configuration.HF_NAMES``). Choices the paper leaves open are fields here (docs/model.md): the
short-conv activation, whether the attention query gets a conv, rotary embedding in the attention path,
the head dims d_k (``kv_channels``) and d_v (``value_head_dim``).
"""

import copy
from dataclasses import dataclass, fields
from enum import IntEnum
from typing import Dict, Optional, Tuple

from oryx_megatron.config.pattern import ORYX_BLOCK, LayerPatternError, layer_mixers, pattern_letters


class Mode(IntEnum):
    """Values of the ``modes`` tensor [batch, seq]: the mixer each token reads with (room is left
    for more mixers)."""

    LINEAR = 0
    ATTENTION = 1


ATTENTION = "attention"
KV_GATES = ("none", "silu", "sigmoid")
CONV_ACTIVATIONS = ("silu", None)


class MixerConfigError(ValueError):
    """A bad mixer hyperparameter; ``field`` names it (a run config reports it as ``model.<field>``)."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


@dataclass
class MixerConfig:
    """The hyperparameters of one Oryx mixer (and of the single-mixer baselines built from it).

    ``num_attention_heads`` is the number of heads H of the block, shared by both mixers; ``kv_channels``
    is d_k (keys and both queries) and ``value_head_dim`` d_v. Which linear mixers exist is the mixer
    core's registry (``oryx_megatron.mixer.linear.LINEAR_MIXERS``); this schema checks the rest.
    """

    hidden_size: int = 0
    num_attention_heads: int = 0

    kv_channels: Optional[int] = None
    """d_k; hidden_size // num_attention_heads when unset."""

    layernorm_epsilon: float = 1e-5
    """Epsilon of the per-head output norm (and of the layer norms)."""

    mixers: str = "attention+gdn"
    """'+'-separated mixers of every layer: 'attention+gdn' (Oryx-TG), 'attention+mamba2' (Oryx-TM), or one
    mixer alone for the single-mixer baselines ('gdn', 'mamba2'); at most one linear mixer."""

    layer_pattern: Optional[str] = None
    """One letter per layer (config/pattern.py): M Mamba-2, G Gated DeltaNet, * attention, O the Oryx block of
    ``mixers``; spaces ignored, | between pipeline stages. None: every layer has ``mixers``."""

    value_head_dim: Optional[int] = None
    """d_v; defaults to kv_channels (d_k)."""

    mixer_conv_kernel: int = 4
    """Width of the depthwise causal short convs on K, V and the linear query."""

    mixer_conv_activation: Optional[str] = "silu"
    """Activation after the short convs: 'silu' or None."""

    attention_query_conv: bool = False
    """Give the attention query a short conv too (off = a plain Transformer query)."""

    shared_query: bool = False
    """One query for both mixers: the linear query is also the attention query, as the key is (ablation A1).
    Multi-mixer only."""

    kv_gate: str = "none"
    """Multiplicative gates on the shared keys and values, from the layer input:
    k_t = act(conv_k(W_K x))_t * gate(W_KG x_t), likewise v; 'none', 'silu' or 'sigmoid'."""

    attention_rotary: bool = True
    """Rotary embedding on the attention query and key (inside the attention path only)."""

    rotary_base: float = 10000.0

    linear_chunk_size: int = 64
    """Chunk length of the chunked linear-recurrence kernels (not the mode chunk)."""

    A_init_range: Tuple[float, float] = (1.0, 16.0)
    """Decay rates A = exp(A_log) drawn uniformly from this range (Mamba-2's initialisation)."""

    dt_min: float = 0.001
    dt_max: float = 0.1
    dt_init_floor: float = 1e-4
    """Time steps drawn log-uniformly from [dt_min, dt_max], at least dt_init_floor (dt_bias = softplus^-1)."""

    kernel_backend: str = "auto"
    """'auto' (CUDA kernels where present, env ORYX_KERNEL_BACKEND overrides), 'torch' or 'cuda'."""

    def __post_init__(self):
        self.check_mixer_fields()

    def check_mixer_fields(self) -> None:
        """Fill the derived defaults (d_k, d_v) and check every field; MixerConfigError names the first bad one."""
        if self.kv_channels is None and self.num_attention_heads:
            self.kv_channels = self.hidden_size // self.num_attention_heads
        if self.value_head_dim is None:
            self.value_head_dim = self.kv_channels
        self.A_init_range = tuple(self.A_init_range)
        mixers = self.mixer_list
        if not mixers or len(set(mixers)) != len(mixers):
            raise MixerConfigError("mixers", f"mixers={self.mixers!r}: expected distinct mixers joined by '+', "
                                             "e.g. 'attention+gdn'")
        if sum(m != ATTENTION for m in mixers) > 1:
            raise MixerConfigError("mixers", f"mixers={self.mixers!r}: at most one linear mixer per layer")
        if self.layer_pattern is not None:
            try:
                letters = pattern_letters(self.layer_pattern)
            except LayerPatternError as e:
                raise MixerConfigError("layer_pattern", str(e)) from None
            if ORYX_BLOCK in letters and len(mixers) < 2:
                raise MixerConfigError("layer_pattern", f"layer_pattern={self.layer_pattern!r}: an Oryx block "
                                                        f"({ORYX_BLOCK!r}) reads two mixers; mixers={self.mixers!r} "
                                                        "has one")
        for name in ("hidden_size", "num_attention_heads", "kv_channels", "value_head_dim", "mixer_conv_kernel",
                     "linear_chunk_size"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise MixerConfigError(name, f"{name}={getattr(self, name)!r} must be a positive integer")
        choices = {"mixer_conv_activation": CONV_ACTIVATIONS, "kv_gate": KV_GATES}
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise MixerConfigError(name, f"{name}={getattr(self, name)!r}: expected one of {allowed}")
        if self.shared_query and not self.is_multi_mixer:
            raise MixerConfigError("shared_query", f"shared_query=True needs two mixers to share it, got "
                                                   f"mixers={self.mixers!r}")
        if self.attention_rotary and self.kv_channels % 2:
            raise MixerConfigError("kv_channels", f"kv_channels={self.kv_channels} must be even for rotary embedding")
        low, high = self.A_init_range
        if not 0 < low <= high:
            raise MixerConfigError("A_init_range", f"A_init_range={self.A_init_range}: expected 0 < low <= high")
        if not 0 < self.dt_min <= self.dt_max:
            raise MixerConfigError("dt_min", f"dt_min={self.dt_min}, dt_max={self.dt_max}: expected "
                                             "0 < dt_min <= dt_max")

    @property
    def mixer_list(self) -> Tuple[str, ...]:
        """The mixers of an Oryx block (of every layer without a pattern)."""
        return tuple(m.strip() for m in self.mixers.split("+") if m.strip())

    @property
    def has_attention(self) -> bool:
        return ATTENTION in self.mixer_list

    @property
    def linear_mixer(self) -> Optional[str]:
        """The linear mixer's name ('gdn', 'mamba2', ...) or None."""
        return next((m for m in self.mixer_list if m != ATTENTION), None)

    @property
    def is_multi_mixer(self) -> bool:
        """Some layer reads with each token's mode: an Oryx block (``mixers`` of two, and an O in the pattern)."""
        return len(self.mixer_list) > 1 and (self.layer_pattern is None or ORYX_BLOCK in self.layer_pattern)

    def check_pattern_length(self, num_layers: int, layers_name: str = "num_layers") -> None:
        """MixerConfigError unless the pattern has one letter per layer (``layers_name``: the front end's name of
        the layer count)."""
        letters = None if self.layer_pattern is None else pattern_letters(self.layer_pattern)
        if letters is not None and len(letters) != num_layers:
            raise MixerConfigError("layer_pattern", f"layer_pattern={self.layer_pattern!r} has {len(letters)} layers; "
                                                    f"the model has {layers_name}={num_layers}")

    def layer_config(self, index: int):
        """The config of layer ``index`` (0-based): a copy whose ``mixers`` are that layer's, without a pattern
        (``shared_query`` kept by an Oryx block only). Without a pattern, this config."""
        if self.layer_pattern is None:
            return self
        layer = copy.copy(self)
        layer.mixers = layer_mixers(self.layer_pattern, self.mixers)[index]
        layer.layer_pattern = None
        layer.shared_query = self.shared_query and layer.is_multi_mixer
        return layer

    def mixer_fields(self) -> Dict[str, object]:
        """This config's values of MixerConfig's fields (what a front end's config maps)."""
        return {f.name: getattr(self, f.name) for f in fields(MixerConfig)}


MIXER_FIELDS = tuple(f.name for f in fields(MixerConfig))
