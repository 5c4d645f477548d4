"""The schema of a model recipe (recipes/model/*.yaml): ``ModelArgs``, the family, the model's shape and
every ``MixerConfig`` field (a recipe can set any of them, ``mixers`` included); the router's are ``RouterConfig``'s
(config/router.py), of which ``ModelArgs`` keeps the former keys as aliases."""

from dataclasses import dataclass
from typing import Optional

from oryx_megatron.config.mixer import MixerConfig, MixerConfigError
from oryx_megatron.config.pattern import pattern_letters

MISSING = "???"  # omegaconf's marker of a mandatory value (omegaconf.MISSING), without importing omegaconf

# The mixers of each family ("oryx": any mixers, given by model.mixers); the Transformer baseline is megatron's
# GPTModel, whose layers read with attention.
FAMILY_MIXERS = {
    "oryx_tg": "attention+gdn",
    "oryx_tm": "attention+mamba2",
    "gdn": "gdn",
    "mamba2": "mamba2",
    "transformer": "attention",
    "oryx": None,
}
TRANSFORMER = "transformer"
REQUIRED = ("family", "num_layers", "hidden_size", "num_attention_heads")


@dataclass
class ModelArgs(MixerConfig):
    """A model recipe. ``mixers`` (None: the family's) may be set for ``family: oryx`` only, e.g. a new linear
    mixer's ``attention+retention``; the other families fix theirs."""

    family: str = MISSING
    num_layers: int = MISSING
    hidden_size: int = MISSING
    num_attention_heads: int = MISSING
    mixers: Optional[str] = None
    ffn_hidden_size: Optional[int] = None  # 4 * hidden_size when unset (megatron's default)
    vocab_size: int = 50304  # the tokenizer's; the embedding is padded (see models.builder.padded_vocab_size)
    make_vocab_size_divisible_by: int = 128
    max_sequence_length: int = 2048
    share_embeddings_and_output_weights: bool = True
    init_method_std: float = 0.02
    transformer_impl: str = "local"  # or "transformer_engine"
    # aliases of router.hidden, router.chunk_size, router.layers (config/router.py), the keys of the router's
    # architecture before it had its schema: oryx-train moves them there; a recipe built alone takes its router from them
    router_hidden: Optional[int] = None
    router_chunk_size: Optional[int] = None
    router_layers: Optional[int] = None

    def __post_init__(self):
        """The family's mixers filled in, the mixer fields checked on a copy (kv_channels and value_head_dim
        stay unset here, as the recipe wrote them); MixerConfigError names the field."""
        for name in REQUIRED:
            if getattr(self, name) == MISSING:
                raise MixerConfigError(name, f"model.{name} is required")
        if self.family not in FAMILY_MIXERS:
            raise MixerConfigError("family", f"model.family={self.family!r}: expected one of {sorted(FAMILY_MIXERS)}")
        preset = FAMILY_MIXERS[self.family]
        if self.mixers is None and preset is None:
            raise MixerConfigError("mixers", "model.mixers: family 'oryx' takes its mixers from model.mixers, "
                                             "e.g. 'attention+gdn'")
        if preset is not None and self.mixers not in (None, preset):
            raise MixerConfigError("mixers", f"model.mixers={self.mixers!r}: family {self.family!r} has the mixers "
                                             f"{preset!r}; other mixers are family 'oryx'")
        self.mixers = self.mixers or preset
        MixerConfig(**self.mixer_fields()).check_pattern_length(self.num_layers)
        if self.is_transformer and self.layer_pattern is not None and set(pattern_letters(self.layer_pattern)) != {"*"}:
            raise MixerConfigError("layer_pattern", f"layer_pattern={self.layer_pattern!r}: family "
                                                    "'transformer' is megatron's GPTModel, attention ('*') at every "
                                                    "layer; a layer-axis hybrid is family mamba2 or gdn, with Oryx "
                                                    "blocks ('O') oryx_tm or oryx_tg")

    @property
    def is_transformer(self) -> bool:
        return self.family == TRANSFORMER
