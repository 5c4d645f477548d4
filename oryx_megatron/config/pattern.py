"""Layer patterns (``model.layer_pattern``): one letter per layer, the hybrid along the layers that megatron builds
from ``hybrid_override_pattern``, with the Oryx block as one more letter.

Each letter is a whole layer of this project, its sequence mixer and its SwiGLU MLP (megatron's patterns give the
MLP a letter of its own, ``-``: a pattern here maps to megatron's by writing every letter as that letter and ``-``,
``MMMO`` as ``M-M-M-O-``):

    M   Mamba-2 alone                     (megatron's M)
    G   Gated DeltaNet alone              (megatron's G, from megatron-core 0.17)
    *   softmax attention alone           (megatron's *): the Oryx core's attention mixer, so context
                                          parallelism, packed documents, caches and the HF model follow
    O   the Oryx block: attention and the model's linear mixer sharing K, V, gate and output projection,
        read by each token's mode. 'O' is none of megatron's letters (M G * D + - E | / in 0.19).
    |   a pipeline stage boundary (megatron's), the stages' layers as the user splits them
    spaces are ignored: ``MMMO MMMO``.

A mixer plugin (config/plugins.py) adds letters of its own: its mixer alone in a layer (``N`` for the tests'
plugin's ``lanorm``).

The mixers of an ``O`` layer are the model's ``mixers`` (``attention+gdn`` for Oryx-TG); the other letters fix
theirs. Without a pattern every layer has the model's ``mixers``, so every family of today is the pattern of one
letter repeated (``oryx_tg``: ``O`` x num_layers, ``gdn``: ``G`` x num_layers).
"""

from typing import Dict, Tuple

from oryx_megatron.config.plugins import PluginError, mixer_plugins

ORYX_BLOCK = "O"
PIPELINE_BOUNDARY = "|"
LAYER_MIXERS: Dict[str, str] = {"M": "mamba2", "G": "gdn", "*": "attention"}  # the single-mixer letters
NAMES = "M Mamba-2, G Gated DeltaNet, * attention, O the Oryx block"


def layer_letters() -> Dict[str, str]:
    """Every single-mixer letter, the package's and the mixer plugins': letter -> mixer. PluginError names a
    plugin whose letter is taken or not one character."""
    letters = dict(LAYER_MIXERS)
    for name, plugin in mixer_plugins().items():
        for letter, mixer in plugin.letters.items():
            if len(letter) != 1 or letter.isspace() or letter in (*letters, ORYX_BLOCK, PIPELINE_BOUNDARY):
                raise PluginError(f"mixer plugin {name!r}: layer-pattern letter {letter!r} is taken or not one "
                                  f"character (the package's: {' '.join(LAYER_MIXERS)} {ORYX_BLOCK} "
                                  f"{PIPELINE_BOUNDARY})")
            letters[letter] = mixer
    return letters


class LayerPatternError(ValueError):
    """A bad layer pattern (one line that names the letter or the count)."""


def pattern_stages(pattern: str) -> Tuple[str, ...]:
    """The pattern's letters per pipeline segment (split at ``|``; one segment without), spaces removed;
    LayerPatternError names an unknown letter or an empty segment."""
    stages = tuple("".join(segment.split()) for segment in pattern.split(PIPELINE_BOUNDARY))
    letters = layer_letters()
    for segment in stages:
        unknown = sorted(set(segment) - set(letters) - {ORYX_BLOCK})
        if unknown:
            plugins = {letter: mixer for letter, mixer in letters.items() if letter not in LAYER_MIXERS}
            raise LayerPatternError(f"layer_pattern={pattern!r}: unknown letter {unknown[0]!r}; expected one of "
                                    f"{' '.join((*LAYER_MIXERS, ORYX_BLOCK, *plugins))} ({NAMES}"
                                    f"{''.join(f', {letter} {mixer}' for letter, mixer in plugins.items())}), "
                                    f"spaces, and | between pipeline stages")
        if not segment:
            raise LayerPatternError(f"layer_pattern={pattern!r}: a pipeline segment without layers (between two |, "
                                    f"or at an end)")
    return stages


def pattern_letters(pattern: str) -> str:
    """The pattern's letters, one per layer (spaces and ``|`` removed)."""
    return "".join(pattern_stages(pattern))


def layer_mixers(pattern: str, oryx_mixers: str) -> Tuple[str, ...]:
    """Per layer, its ``mixers`` (the ``MixerConfig`` field): ``oryx_mixers`` for an ``O``."""
    letters = layer_letters()
    return tuple(oryx_mixers if letter == ORYX_BLOCK else letters[letter] for letter in pattern_letters(pattern))


def pipeline_segments(pattern: str, stages: int):
    """The layers of each pipeline stage where ``pattern`` splits them at ``|`` (``stages``: pipeline x virtual
    pipeline size); None where megatron splits them evenly: no ``|``, or one stage (a pattern runs in one process
    too). LayerPatternError when the segments are not one per stage."""
    segments = pattern_stages(pattern)
    if len(segments) == 1 or stages == 1:
        return None
    if len(segments) != stages:
        raise LayerPatternError(f"layer_pattern={pattern!r} splits the layers into {len(segments)} pipeline segments "
                                f"at '|'; the run has {stages} pipeline stages (pipeline x virtual pipeline size)")
    return [len(segment) for segment in segments]
