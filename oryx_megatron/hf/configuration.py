"""``OryxHFConfig``: the transformers config of an Oryx model (``model_type: "oryx"``).

Every field the model's math needs is a field here: ``oryx_megatron.config.MixerConfig``'s, under the names
transformers users know (``HF_NAMES``: ``head_dim`` is d_k, ...), the router's architecture (``RouterConfig``'s
``hidden``, ``chunk_size``, ``layers`` as ``router_hidden``, ... : ``ROUTER_NAMES``), and the model's own
(``intermediate_size`` the MLP width, ...), so that an exported folder loads with nothing but this package. What describes the
training run and not the model (the run config, the training mode schedule, the iteration) is metadata in
``oryx``: import reads it back; the model ignores it.

New model parts (the learned router of issue #23, ...) are new fields with a default that means
"absent" and new weight names (``layout.py``): folders written before them keep loading.
"""

import os
from dataclasses import fields
from pathlib import Path
from typing import Dict, Optional, Union

from transformers import PretrainedConfig

from oryx_megatron.config import MIXER_FIELDS, MixerConfig, MixerConfigError, RouterConfig, RouterConfigError
from oryx_megatron.config.plugins import ENTRY_POINTS, mixer_plugins
from oryx_megatron.config.router import ALIASES, check_router
from oryx_megatron.hf.remote_code import carried, code_hash, model_code, write_model_code
from oryx_megatron.mixer import linear_mixer_class, linear_mixers

MODEL_TYPE = "oryx"
FORMAT_VERSION = 1  # of the folder layout; a change that old readers cannot load raises it
MODE_NAMES = ("attention", "linear")

# MixerConfig field -> its name in a Hugging Face config (the names transformers users know); the one mapping.
HF_NAMES = {
    "kv_channels": "head_dim",
    "layernorm_epsilon": "rms_norm_eps",
    "mixer_conv_kernel": "conv_kernel",
    "mixer_conv_activation": "conv_activation",
    "rotary_base": "rope_theta",
}
# A config made without arguments (transformers makes one to find a saved config's non-default values).
MIXER_DEFAULTS = {**{f.name: f.default for f in fields(MixerConfig)},
                  "hidden_size": 768, "num_attention_heads": 12, "kv_channels": 64}
# RouterConfig's architecture -> its keys in a Hugging Face config (router_hidden None: the model has no router): the
# names a model recipe gave them before the router had its schema
ROUTER_NAMES = ALIASES
ROUTER_DEFAULTS = {name: getattr(RouterConfig(), key) for key, name in ROUTER_NAMES.items()}


def hf_name(field: str) -> str:
    """A MixerConfig field's name in ``OryxHFConfig``."""
    return HF_NAMES.get(field, field)

# trust_remote_code=True: the folder's two modules (generated with the rest of the code it needs: hf/remote_code.py).
AUTO_MAP = {"AutoConfig": "configuration_oryx.OryxHFConfig", "AutoModelForCausalLM": "modeling_oryx.OryxForCausalLM"}


class OryxHFConfig(PretrainedConfig):
    """An Oryx multi-mixer model (``mixers="attention+gdn"``: Oryx-TG, ``"attention+mamba2"``: Oryx-TM) or a
    single-mixer baseline (``"gdn"``, ``"mamba2"``). Its mixer fields are ``oryx_megatron.config.MixerConfig``'s
    under the names of ``HF_NAMES`` (``mixer_config`` gives them back, checked); the rest describes the model
    around the mixers and how transformers uses it."""

    model_type = MODEL_TYPE
    keys_to_ignore_at_inference = ["cache", "past_key_values"]

    def __init__(
        self,
        vocab_size: int = 50304,  # embedding rows: the tokenizer's vocab padded (the padded ids are never sampled)
        intermediate_size: int = 2048,  # SwiGLU width
        num_hidden_layers: int = 12,
        max_position_embeddings: int = 2048,
        initializer_range: float = 0.02,
        tie_word_embeddings: bool = True,
        default_mode: str = "attention",  # what a token reads when no modes are given (multi-mixer models)
        reset_at_eod_token_id: Optional[int] = None,  # trained with data.reset_at_eod: states restart after it
        training_mode_schedule: Optional[str] = None,  # metadata: data.mode_schedule of the run
        oryx: Optional[dict] = None,  # metadata: format_version, family, the run config, iteration, ...
        bos_token_id: Optional[int] = None,
        eos_token_id: Optional[int] = None,
        pad_token_id: Optional[int] = None,
        use_cache: bool = False,  # forward keeps no state unless asked; generate asks (generation_config)
        **kwargs,  # MixerConfig's fields under their HF_NAMES (hidden_size, head_dim, mixers, ...), the router's
        # (ROUTER_NAMES), transformers'
    ):
        mixer = {hf_name(field): kwargs.pop(hf_name(field), default) for field, default in MIXER_DEFAULTS.items()}
        router = {name: kwargs.pop(name, default) for name, default in ROUTER_DEFAULTS.items()}
        kwargs.setdefault("auto_map", dict(AUTO_MAP))
        super().__init__(**kwargs)
        for name, value in {**mixer, **router}.items():
            setattr(self, name, value)
        if self.value_head_dim is None:
            self.value_head_dim = self.head_dim
        self.vocab_size = vocab_size
        self.intermediate_size = intermediate_size
        self.num_hidden_layers = num_hidden_layers
        self.max_position_embeddings = max_position_embeddings
        self.initializer_range = initializer_range
        self.tie_word_embeddings = tie_word_embeddings
        self.default_mode = default_mode
        self.reset_at_eod_token_id = reset_at_eod_token_id
        self.training_mode_schedule = training_mode_schedule
        self.oryx = {"format_version": FORMAT_VERSION} if oryx is None else dict(oryx)
        self.bos_token_id, self.eos_token_id, self.pad_token_id = bos_token_id, eos_token_id, pad_token_id
        self.use_cache = use_cache
        self._check()

    @property
    def mixer_config(self) -> MixerConfig:
        """The mixer's hyperparameters (checked: MixerConfigError names the field by its MixerConfig name)."""
        return MixerConfig(**{field: getattr(self, hf_name(field)) for field in MIXER_FIELDS})

    @property
    def router_config(self) -> RouterConfig:
        """The chunk router's architecture (``hidden`` None: the model has no router)."""
        return RouterConfig(**{key: getattr(self, name) for key, name in ROUTER_NAMES.items()})

    def _check(self) -> None:
        try:
            linear_mixer_class(self.mixer_config)
            self.mixer_config.check_pattern_length(self.num_hidden_layers, "num_hidden_layers")
        except MixerConfigError as e:
            raise ValueError(f"OryxHFConfig.{hf_name(e.field)}: {e}") from None
        try:
            check_router(self.router_config, self.mixer_config, self.num_hidden_layers, ROUTER_NAMES)
        except RouterConfigError as e:
            raise ValueError(f"OryxHFConfig.{e.key}: {e}") from None
        if self.default_mode not in MODE_NAMES:
            raise ValueError(f"OryxHFConfig.default_mode={self.default_mode!r}: expected one of {MODE_NAMES}")
        version = self.oryx.get("format_version", FORMAT_VERSION)
        if version > FORMAT_VERSION:
            raise ValueError(f"OryxHFConfig.oryx.format_version={version}: written by a newer oryx-megatron "
                             f"(this one reads {FORMAT_VERSION}); upgrade the package")

    def save_pretrained(self, save_directory, *args, **kwargs):
        """transformers' ``save_pretrained`` (which a model's ``save_pretrained`` calls), with the code the folder
        needs (``remote_code.model_code``, the mixer plugins' modules included; its hash as ``oryx.code_sha256``)."""
        code = model_code(self._plugins())
        self.oryx["code_sha256"] = code_hash(code)
        super().save_pretrained(save_directory, *args, **kwargs)
        write_model_code(save_directory, code)

    def _plugins(self) -> Dict[str, str]:
        """The mixer plugins whose mixers the layers use, name -> entry point (none for a folder's model: its code
        is its own); ValueError names a mixer from outside the package that no plugin registered."""
        config = self.mixer_config
        used = sorted({config.layer_config(i).linear_mixer for i in range(self.num_hidden_layers)} - {None})
        by_mixer = {mixer: name for name, plugin in mixer_plugins().items() for mixer in plugin.mixers}
        plugins = {}
        for mixer in used:
            linear = linear_mixers()[mixer]
            if carried(linear.__module__):
                continue
            if mixer not in by_mixer:
                raise ValueError(f"OryxHFConfig.mixers={self.mixers!r}: {linear.__name__} ({linear.__module__}) is "
                                 f"neither a module of oryx-megatron nor a mixer plugin's, so a saved folder cannot "
                                 f"carry its code")
            plugins[by_mixer[mixer]] = ENTRY_POINTS[by_mixer[mixer]]
        return plugins

    @classmethod
    def register_for_auto_class(cls, auto_class="AutoConfig"):
        """A no-op: ``save_pretrained`` writes the folder's code (transformers would copy only the file that
        defines the class)."""

    @property
    def is_multi_mixer(self) -> bool:
        return self.mixer_config.is_multi_mixer
