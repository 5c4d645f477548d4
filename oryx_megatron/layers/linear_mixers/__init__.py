"""Linear mixers by config name (``OryxConfig.mixers``; the names are ``config.LINEAR_MIXERS``,
which cannot import this package)."""

from oryx_megatron.layers.linear_mixers.base import LinearMixer
from oryx_megatron.layers.linear_mixers.gated_deltanet import GatedDeltaNetMixer
from oryx_megatron.layers.linear_mixers.mamba2 import Mamba2Mixer

LINEAR_MIXER_CLASSES = {
    "gdn": GatedDeltaNetMixer,
    "mamba2": Mamba2Mixer,
}

__all__ = ["LINEAR_MIXER_CLASSES", "LinearMixer", "GatedDeltaNetMixer", "Mamba2Mixer"]
