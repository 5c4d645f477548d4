"""The linear mixers of the Oryx block, by the name ``MixerConfig.mixers`` gives them.

Adding one (docs/model.md, "Adding a linear mixer"): a ``LinearMixer`` subclass in a file of its own, and
its entry here (code outside the package, a test for instance, adds its entry to ``LINEAR_MIXERS``).
"""

from typing import Dict, Type

from oryx_megatron.config import MixerConfig, MixerConfigError
from oryx_megatron.mixer.linear.base import LinearMixer
from oryx_megatron.mixer.linear.gated_deltanet import GatedDeltaNetMixer
from oryx_megatron.mixer.linear.mamba2 import Mamba2Mixer

LINEAR_MIXERS: Dict[str, Type[LinearMixer]] = {
    "gdn": GatedDeltaNetMixer,  # Oryx-TG
    "mamba2": Mamba2Mixer,  # Oryx-TM
}


def linear_mixer_class(config: MixerConfig):
    """The LinearMixer class of ``config.mixers``, None for attention alone; MixerConfigError names an
    unknown mixer."""
    name = config.linear_mixer
    if name is None:
        return None
    if name not in LINEAR_MIXERS:
        raise MixerConfigError("mixers", f"mixers={config.mixers!r}: unknown mixer {name!r}; expected 'attention' "
                                         f"and at most one of {sorted(LINEAR_MIXERS)} (oryx_megatron/mixer/linear)")
    return LINEAR_MIXERS[name]


__all__ = ["LINEAR_MIXERS", "LinearMixer", "GatedDeltaNetMixer", "Mamba2Mixer", "linear_mixer_class"]
