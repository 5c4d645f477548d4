"""The linear mixers of the Oryx block, by the name ``MixerConfig.mixers`` gives them.

Adding one (docs/model.md, "Adding a linear mixer"): a ``LinearMixer`` subclass in a file of its own, and
its entry here; a distribution of its own registers its mixers through the entry point group
``oryx_megatron.mixers`` (``config.plugins``, loaded at the first ``linear_mixers``); code of a process (a test)
may add its entry to ``LINEAR_MIXERS``.
"""

from typing import Dict, Type

from oryx_megatron.config import ATTENTION, MixerConfig, MixerConfigError
from oryx_megatron.config.plugins import PluginError, mixer_plugins
from oryx_megatron.mixer.linear.base import LinearMixer
from oryx_megatron.mixer.linear.gated_deltanet import GatedDeltaNetMixer
from oryx_megatron.mixer.linear.mamba2 import Mamba2Mixer

LINEAR_MIXERS: Dict[str, Type[LinearMixer]] = {
    "gdn": GatedDeltaNetMixer,  # Oryx-TG
    "mamba2": Mamba2Mixer,  # Oryx-TM
}


_PLUGINS_ADDED = False


def linear_mixers() -> Dict[str, Type[LinearMixer]]:
    """Every registered linear mixer (``LINEAR_MIXERS``), the mixer plugins' added at the first call, all or none:
    PluginError names a plugin's mixer whose name is taken or that is not a ``LinearMixer``, and every later call
    repeats it."""
    global _PLUGINS_ADDED
    if not _PLUGINS_ADDED:
        added = {}
        for plugin_name, plugin in mixer_plugins().items():
            for name, mixer in plugin.mixers.items():
                if name == ATTENTION or name in LINEAR_MIXERS:
                    taken = "the attention mixer" if name == ATTENTION else _where(LINEAR_MIXERS[name])
                    raise PluginError(f"mixer plugin {plugin_name!r}: the mixer name {name!r} is taken by {taken}")
                if not (isinstance(mixer, type) and issubclass(mixer, LinearMixer)):
                    raise PluginError(f"mixer plugin {plugin_name!r}: mixer {name!r} is {mixer!r}, not a subclass "
                                      f"of oryx_megatron.mixer.LinearMixer")
                added[name] = mixer
        LINEAR_MIXERS.update(added)
        _PLUGINS_ADDED = True
    return LINEAR_MIXERS


def linear_mixer_class(config: MixerConfig):
    """The LinearMixer class of ``config.mixers``, None for attention alone; MixerConfigError names an
    unknown mixer."""
    name = config.linear_mixer
    if name is None:
        return None
    mixers = linear_mixers()
    if name not in mixers:
        raise MixerConfigError("mixers", f"mixers={config.mixers!r}: unknown mixer {name!r}; expected 'attention' "
                                         f"and at most one of {sorted(mixers)} (oryx_megatron/mixer/linear, and the "
                                         f"mixer plugins installed: docs/model.md)")
    return mixers[name]


def _where(mixer: type) -> str:
    return f"{mixer.__module__}.{mixer.__qualname__}"


__all__ = ["LINEAR_MIXERS", "LinearMixer", "GatedDeltaNetMixer", "Mamba2Mixer", "linear_mixer_class",
           "linear_mixers"]
