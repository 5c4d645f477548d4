"""Baselines of matched size: the MLP width at which a model has a reference model's parameter count.

The knob is ``ffn_hidden_size``; depth, hidden size, heads and head dims stay those of the
model's recipe, so the families compare mixers of one shape and only the MLP absorbs the
difference. The count is linear in the MLP width (SwiGLU: 3 * hidden * ffn per layer), so a
step of ``granule`` moves it by a fixed amount, fine enough for 2% at the tiny shapes
(E1: 3 * 64 * 8 * 4 layers = 6k of ~210k). ``hidden_size`` would be the coarser knob: with
heads dividing it, one step moves a 64-wide model's count by ~12%. Counts are those of the
model built on the meta device, as ``oryx-params`` counts them.
"""

import dataclasses

from oryx_megatron.config import ModelArgs
from oryx_megatron.models.params import meta_model

TOLERANCE = 0.02  # relative difference allowed between the counts


def parameter_count(args: ModelArgs) -> int:
    return sum(p.numel() for p in meta_model(args)[0].parameters())


def with_ffn(args: ModelArgs, ffn: int) -> ModelArgs:
    return dataclasses.replace(args, ffn_hidden_size=ffn)


def matched_ffn(reference: ModelArgs, other: ModelArgs, granule: int = 8, max_ffn: int = None,
                tolerance: float = TOLERANCE) -> int:
    """The multiple of ``granule`` in [granule, max_ffn] (default 8 * hidden_size) for
    ``other.ffn_hidden_size`` whose parameter count is nearest ``reference``'s; ValueError
    if that count is not within ``tolerance`` (relative) of the reference's."""
    target = parameter_count(reference)
    max_ffn = max_ffn or 8 * other.hidden_size
    low = parameter_count(with_ffn(other, granule))
    per_step = parameter_count(with_ffn(other, 2 * granule)) - low  # params per granule of MLP width
    steps = round((target - low) / per_step) + 1
    ffn = min(max(steps, 1), max_ffn // granule) * granule
    count = parameter_count(with_ffn(other, ffn))
    if abs(count / target - 1) > tolerance:
        raise ValueError(
            f"no model.ffn_hidden_size in [{granule}, {max_ffn}] (multiples of {granule}) brings {other.family} "
            f"within {tolerance:.0%} of {reference.family}'s {target:,} parameters: the nearest, {ffn}, gives "
            f"{count:,} ({count / target - 1:+.1%}); change model.hidden_size or model.num_layers")
    return ffn
