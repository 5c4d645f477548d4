"""Builders shared by the tests."""

import dataclasses
from typing import Dict, List

import pytest
import torch

from oryx_megatron.config import ModelArgs
from oryx_megatron.config.model import FAMILY_MIXERS
from oryx_megatron.layers.multi_mixer import MultiMixer
from oryx_megatron.mixer import MixerContext, linear_mixers
from oryx_megatron.models.builder import transformer_config
from oryx_megatron.models.specs import get_oryx_layer_local_spec
import tests.mixers  # noqa: F401  (the tests' linear mixers, registered in every process that builds models)


def linear_families() -> List[str]:
    """The recipe of attention with each registered linear mixer (``LINEAR_MIXERS``: the package's and those
    registered from outside it, tests/mixers), in registration order: the family that fixes those mixers where
    there is one ('oryx_tg' for gdn, 'oryx_tm' for mamba2), else the mixers themselves ('attention+gla', family
    'oryx'). What every proof of the mixers runs for (``tiny_args`` and ``build_mixer`` take either)."""
    by_mixers = {mixers: family for family, mixers in FAMILY_MIXERS.items() if mixers}
    return [by_mixers.get(f"attention+{name}", f"attention+{name}") for name in linear_mixers()]


# A layer pattern of every kind of layer (docs/model.md, "Layer patterns"), as the proofs name it beside the families:
# an Oryx-TM block, attention, Mamba-2, Gated DeltaNet ("<family> <layer_pattern>").
PATTERN = "oryx_tm O*MG"


def linear_mixer_of(family: str) -> str:
    """The linear mixer's name of a ``linear_families`` entry: 'oryx_tg' -> 'gdn', 'attention+gla' -> 'gla'."""
    return FAMILY_MIXERS.get(family, family).split("+")[-1]


def from_outside(family: str) -> bool:
    """Whether the linear mixer of ``family`` (a ``linear_families`` entry) is registered from outside the
    package (a test's, or a plugin's)."""
    return not linear_mixers()[linear_mixer_of(family)].__module__.startswith("oryx_megatron.")


def family_cases(*variants, families=None, ids=None) -> list:
    """pytest parameters (family, variant) for each of ``families`` (default: ``linear_families``) and every variant,
    the family in the id (``-k gla``, ``-k lanorm``). ``ids``: the variants' names in the test ids (default: their
    values)."""
    names = dict(zip(variants, ids or variants))
    return [pytest.param(family, variant, id=f"{family}-{names[variant]}")
            for family in (families or linear_families()) for variant in variants]


def recipe_fields(family: str) -> Dict[str, object]:
    """The ModelArgs fields of a family name, of mixers ('attention+gla': family 'oryx' with those mixers), or of a
    family and a layer pattern ('oryx_tm O*MG', ``PATTERN``: as many layers as letters)."""
    if " " in family:
        family, pattern = family.split(" ", 1)
        return {"family": family, "layer_pattern": pattern, "num_layers": len(pattern.replace(" ", ""))}
    return {"family": "oryx", "mixers": family} if "+" in family else {"family": family}


def tiny_args(family="oryx_tg", **overrides) -> ModelArgs:
    """A tiny recipe of ``family``: a family name, or the mixers of family 'oryx' ('attention+gla')."""
    fields = dict(
        num_layers=2, hidden_size=64, num_attention_heads=4, kv_channels=16,
        ffn_hidden_size=128, vocab_size=97, max_sequence_length=128, linear_chunk_size=8,
        kernel_backend="torch",
    )
    fields.update(recipe_fields(family), **overrides)
    return ModelArgs(**fields)


def build_mixer(family="oryx_tg", seed=0, dtype=torch.float64, parallel=None, mixers=None, **overrides) -> MultiMixer:
    """A MultiMixer of a tiny recipe (``tiny_args``); `mixers` overrides the family's mixer list (family "oryx":
    gives it)."""
    recipe = tiny_args(family, **overrides, **({"mixers": mixers} if family == "oryx" else {}))
    config = transformer_config(recipe, params_dtype=dtype, **(parallel or {}))
    if mixers is not None:
        config = dataclasses.replace(config, mixers=mixers)
    torch.manual_seed(seed)
    spec = get_oryx_layer_local_spec().submodules.mixer
    return MultiMixer(config, spec.submodules).to(dtype)


def mix(mixer, x, modes, cache=None, document_ids=None):
    """The mixer's output [s, b, hidden] for x [s, b, hidden] and modes as the model hands them down (one
    ``MixerContext``); with ``cache`` a prefill, or, for one token after cached ones, a decode step: x[0] [b, hidden],
    as both front ends hand it to a layer, which ``OryxMixer.step`` computes."""
    if torch.is_tensor(modes) and modes.dim() == 1:  # one token per sequence: [b] -> [b, 1]
        modes = modes[:, None]
    decode = cache is not None and cache.seqlen > 0 and x.shape[0] == 1
    context = MixerContext.build(mixer.config, modes, document_ids, decode=decode)
    return mixer(x[0], context, cache)[0][None] if decode else mixer(x, context, cache)[0]
