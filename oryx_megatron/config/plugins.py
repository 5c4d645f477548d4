"""Mixer plugins: a distribution of its own registers linear mixers (and their layer-pattern letters) through the
entry point group ``oryx_megatron.mixers``, as vLLM's plugins register through ``vllm.general_plugins``; every
command sees them with no launcher (docs/model.md, "Mixer plugins"). In the plugin's pyproject.toml:

    [project.entry-points."oryx_megatron.mixers"]
    lanorm = "oryx_lanorm:PLUGIN"          # PLUGIN = MixerPlugin(mixers={"lanorm": ...}, letters={"N": "lanorm"})

The plugins are loaded once, where a registry is first read (``mixer.linear.linear_mixers``, the layer-pattern
letters): importing a plugin's module registers its ops (``register_op``); the mixers join ``LINEAR_MIXERS``. An
exported folder carries the modules of the plugins its model uses (``hf.remote_code``) and reads those instead.
"""

from dataclasses import dataclass, field
from importlib.metadata import entry_points
from typing import Dict, Mapping, Optional

GROUP = "oryx_megatron.mixers"
# False in an exported folder's copy of this module: a folder's plugins are the ones it carries, not those installed
IN_PACKAGE = __name__ == "oryx_megatron.config.plugins"


class PluginError(ValueError):
    """A mixer plugin that cannot be used (one line that names it)."""


@dataclass(frozen=True)
class MixerPlugin:
    """What a plugin registers: ``mixers``, name -> its ``LinearMixer`` subclass; ``letters``, a layer-pattern letter
    -> one of its mixers (that mixer alone in a layer, as ``G`` is Gated DeltaNet)."""

    mixers: Mapping[str, type]
    letters: Mapping[str, str] = field(default_factory=dict)


_LOADED: Optional[Dict[str, MixerPlugin]] = None
_LOADING: Optional[str] = None  # the plugin being imported: its import must not read the registry (it is not built)
_REFUSED: Optional[PluginError] = None  # the first refusal, repeated: a plugin's module is imported once
ENTRY_POINTS: Dict[str, str] = {}  # plugin name -> its entry point's value, "module:attribute" (what a folder carries)


def carried_plugins() -> Dict[str, MixerPlugin]:
    """The plugins an exported folder carries, by name: its copy of this function imports them from its own modules
    (written by ``hf.remote_code``); the package carries none."""
    return {}  # the folder's plugins (hf.remote_code)


def mixer_plugins() -> Dict[str, MixerPlugin]:
    """The installed plugins by their entry point's name, loaded at the first call. PluginError names a plugin that
    fails to import, is not a ``MixerPlugin`` or reads the registry while it is imported, and two plugins that claim
    one mixer name or letter; a refusal is repeated by every later call (nothing of it is registered)."""
    global _LOADED, _LOADING, _REFUSED
    if _LOADING is not None:
        raise PluginError(f"mixer plugin {_LOADING!r} reads the mixer registry while it is imported; read it in a "
                          f"function the plugin calls later")
    if _REFUSED is not None:
        raise _REFUSED
    if _LOADED is None and not IN_PACKAGE:
        _LOADED = carried_plugins()
    if _LOADED is None:
        try:
            _LOADED = _load()
        except PluginError as e:
            _REFUSED = e
            raise
    return _LOADED


def _load() -> Dict[str, MixerPlugin]:
    global _LOADING
    loaded, claims, values = {}, {}, {}
    for point in sorted(entry_points(group=GROUP), key=lambda point: point.name):
        _LOADING = point.name
        try:
            plugin = point.load()
        except PluginError:  # its import read the registry (above)
            raise
        except Exception as e:  # any error of the plugin's import: reported in one line, by name
            raise PluginError(f"mixer plugin {point.name!r} ({point.value}) failed to import: "
                              f"{type(e).__name__}: {e}") from None
        finally:
            _LOADING = None
        if not isinstance(plugin, MixerPlugin):
            raise PluginError(f"mixer plugin {point.name!r}: {point.value} is a {type(plugin).__name__}, not a "
                              f"oryx_megatron.config.MixerPlugin")
        for kind, names in (("mixer", plugin.mixers), ("letter", plugin.letters)):
            for name in names:
                other = claims.setdefault((kind, name), point.name)
                if other != point.name:
                    raise PluginError(f"mixer plugins {other!r} and {point.name!r} both register the {kind} "
                                      f"{name!r}; uninstall one")
        for letter, mixer in plugin.letters.items():
            if mixer not in plugin.mixers:
                raise PluginError(f"mixer plugin {point.name!r}: letter {letter!r} names {mixer!r}, not one of "
                                  f"its mixers {sorted(plugin.mixers)}")
        loaded[point.name], values[point.name] = plugin, point.value
    ENTRY_POINTS.update(values)
    return loaded
