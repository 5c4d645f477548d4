"""The schemas every part shares, with no megatron or transformers import: the mode vocabulary and the mixer's
hyperparameters (``mixer``), the model recipe (``model``), the chunk router's hyperparameters (``router``). The run
config of ``oryx-train`` is ``oryx_megatron.run_config``."""

from oryx_megatron.config.mixer import (
           ATTENTION,
           KV_GATES,
           MIXER_FIELDS,
           MixerConfig,
           MixerConfigError,
           Mode,
)
from oryx_megatron.config.model import FAMILY_MIXERS, ModelArgs
from oryx_megatron.config.plugins import MixerPlugin, PluginError
from oryx_megatron.config.router import RouterConfig, RouterConfigError

__all__ = ["ATTENTION", "FAMILY_MIXERS", "KV_GATES", "MIXER_FIELDS", "MixerConfig", "MixerConfigError", "Mode",
           "MixerPlugin", "ModelArgs", "PluginError", "RouterConfig", "RouterConfigError"]
