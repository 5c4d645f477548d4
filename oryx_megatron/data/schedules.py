"""Inference mode schedules: the mode of every position of a prompt and its continuation (in the data layer, beside
``data.modes``, so that both front ends read them: the megatron model's generation and the Hugging Face model).

For one sequence a schedule's ``position_modes(prompt_len, total_len)`` gives int8 modes
[total_len] for the positions fed to the model: the prompt [0, prompt_len), then the generated
tokens [prompt_len, total_len), where ``total_len = prompt_len + max_new_tokens - 1`` (the last
generated token is never fed). Token t reads with mode t, and that read predicts token t + 1:
the first generated token comes from the read of the last prompt token.

The schedules of training (``data.modes``) keep their names and fields here; only inference adds
forms tied to the prompt or to absolute positions:

- ``PositionSchedule(schedule)``: a data-layer ``ModeSchedule`` applied to positions
  [0, total_len): ``all_attention``, ``all_linear``, ``linear_then_attention n_last=16``,
  ``switch_at t=100 before=linear after=attention``, ``explicit chunk_modes=[0,1] chunk_size=64``, ...
  (the text form of ``data.modes.build_mode_schedule``);
- ``PhaseSchedule(prefill, decode)``: one mode for the prompt, one for the generated tokens,
  ``prefill=linear decode=attention``;
- ``SpanSchedule``: explicit absolute spans, ``linear:0-100,attention:100-`` (the last span
  may be open-ended);
- ``RouterSchedule``: each chunk's mode chosen by the model's router, ``router threshold=0.5`` or
  ``router budget=0.1`` (with ``threshold=P``: that threshold under the budget's quota; ``chunk_size=N``:
  another chunk than the router's); applied by the code that has the model (``generate``,
  ``route_modes``), chunk by chunk.

``parse_schedule(text)`` reads these forms; ``as_inference_schedule`` accepts all of them.
"""

import dataclasses
import re
from typing import Optional, Tuple, Union

import numpy as np

from oryx_megatron.config import Mode
from oryx_megatron.data.modes import SCHEDULES, AllAttention, AllLinear, ModeSchedule, build_mode_schedule, parse_mode

FORMS = (
    f"expected a schedule name ({', '.join(SCHEDULES)}) with its fields as FIELD=VALUE "
    "('linear_then_attention n_last=16'), 'prefill=MODE decode=MODE', spans 'MODE:START-END,...,MODE:START-', "
    "or 'router threshold=P' / 'router budget=FRACTION' (optionally threshold=P, chunk_size=N)"
)


class InferenceSchedule:
    """Base class of the schedules above."""

    def position_modes(self, prompt_len: int, total_len: int) -> np.ndarray:
        """int8 [total_len]: the mode of each position fed for a prompt of ``prompt_len`` tokens."""
        raise NotImplementedError


@dataclasses.dataclass(frozen=True)
class PhaseSchedule(InferenceSchedule):
    """``prefill`` on the prompt tokens, ``decode`` on the generated ones."""

    prefill: Mode
    decode: Mode

    def __post_init__(self):
        object.__setattr__(self, "prefill", parse_mode(self.prefill, "PhaseSchedule.prefill"))
        object.__setattr__(self, "decode", parse_mode(self.decode, "PhaseSchedule.decode"))

    def position_modes(self, prompt_len, total_len):
        return np.where(np.arange(total_len) < prompt_len, self.prefill, self.decode).astype(np.int8)

    def __str__(self):
        return f"prefill={self.prefill.name.lower()} decode={self.decode.name.lower()}"


@dataclasses.dataclass(frozen=True)
class Span:
    """Positions [start, end) in ``mode``; ``end=None`` runs to the end of the sequence."""

    mode: Mode
    start: int
    end: Optional[int] = None

    def __post_init__(self):
        object.__setattr__(self, "mode", parse_mode(self.mode, "Span.mode"))

    def __str__(self):
        return f"{self.mode.name.lower()}:{self.start}-{'' if self.end is None else self.end}"


@dataclasses.dataclass(frozen=True)
class SpanSchedule(InferenceSchedule):
    """Contiguous spans from position 0; only the last may be open-ended."""

    spans: Tuple[Span, ...]

    def __post_init__(self):
        if not self.spans:
            raise ValueError("SpanSchedule.spans must hold at least one span")
        expected = 0
        for i, span in enumerate(self.spans):
            where = f"inference schedule '{self}': span '{span}'"
            if span.start != expected:
                raise ValueError(f"{where} starts at {span.start}, expected {expected} (spans are contiguous from 0)")
            if span.end is None and i < len(self.spans) - 1:
                raise ValueError(f"{where} is open-ended but is not the last span")
            if span.end is not None and span.end <= span.start:
                raise ValueError(f"{where} is empty (end <= start)")
            expected = span.end

    def position_modes(self, prompt_len, total_len):
        end = self.spans[-1].end
        if end is not None and total_len > end:
            raise ValueError(
                f"inference schedule '{self}' covers positions [0, {end}), fewer than the {total_len} "
                f"positions of a prompt of {prompt_len} tokens and its generated tokens"
            )
        modes = np.empty(total_len, np.int8)
        for span in self.spans:
            modes[span.start : span.end] = span.mode
        return modes

    def __str__(self):
        return ",".join(map(str, self.spans))


@dataclasses.dataclass(frozen=True)
class PositionSchedule(InferenceSchedule):
    """A data-layer ModeSchedule over the fed positions (sample index 0, seed 0)."""

    schedule: ModeSchedule

    def position_modes(self, prompt_len, total_len):
        return self.schedule.sample_modes(total_len)

    def __str__(self):
        return str(self.schedule)


@dataclasses.dataclass(frozen=True)
class RouterSchedule(InferenceSchedule):
    """Chunk c reads attention where the router's probability for it reaches the threshold: ``threshold``,
    or, for a ``budget`` (a fraction of the tokens) without one, the router's calibrated (1 - budget)
    quantile but never below 0.5 (a router that wants attention on fewer chunks than the budget reads
    those only, rather than the first ones that come; a router without calibration, a joint one, reads 0.5). A budget adds a quota: no chunk reads attention once
    the chunks so far that did exceed budget x chunks so far + 1, so the budget a stretch of unwanted chunks
    leaves unspent carries forward to later ones. Decisions are made in order, each from the router's logit
    of that chunk alone (which reads only its first token and earlier ones): causal. ``chunk_size`` None:
    the model's router's (router.chunk_size)."""

    threshold: Optional[float] = None
    budget: Optional[float] = None
    chunk_size: Optional[int] = None

    def __post_init__(self):
        if self.threshold is None and self.budget is None:
            raise ValueError(f"inference schedule '{self}': give threshold=P, budget=FRACTION or both")
        for name in ("threshold", "budget"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= 1:
                raise ValueError(f"inference schedule '{self}': {name}={value} is not in [0, 1]")
        if self.chunk_size is not None and self.chunk_size < 1:
            raise ValueError(f"inference schedule '{self}': chunk_size={self.chunk_size} must be positive")

    def position_modes(self, prompt_len, total_len):
        raise TypeError(f"inference schedule '{self}' chooses modes with the model's router: pass it to generate() "
                        "or route_modes(), which have the model")

    def __str__(self):
        fields = [f"{name}={getattr(self, name)}" for name in ("threshold", "budget", "chunk_size")
                  if getattr(self, name) is not None]
        return " ".join(["router", *fields])


ALL_ATTENTION = PositionSchedule(AllAttention())
ALL_LINEAR = PositionSchedule(AllLinear())
LINEAR_PREFILL = PhaseSchedule(Mode.LINEAR, Mode.ATTENTION)  # prefill=linear decode=attention

_SPAN = re.compile(r"^(\w+):(\d+)-(\d*)$")


def parse_schedule(text: str) -> InferenceSchedule:
    """A schedule from its text form (see FORMS); errors name the part that cannot be read."""
    parts = [p for p in re.split(r"[,\s]+", text.strip()) if p]
    if not parts:
        raise ValueError(f"inference schedule {text!r} is empty; {FORMS}")
    if "=" in parts[0]:
        return _parse_phases(text, parts)
    if ":" in parts[0]:
        return SpanSchedule(tuple(_parse_span(text, p) for p in parts))
    if parts[0] == "router":
        return _parse_router(text, parts[1:])
    if parts[0] not in SCHEDULES:
        raise ValueError(f"inference schedule {text!r}: unknown schedule {parts[0]!r}; {FORMS}")
    try:
        return PositionSchedule(build_mode_schedule(text))
    except ValueError as e:
        raise ValueError(f"inference schedule {text!r}: {e}") from None


def _parse_phases(text: str, parts) -> PhaseSchedule:
    fields = {}
    for part in parts:
        key, _, value = part.partition("=")
        if key not in ("prefill", "decode") or not value:
            raise ValueError(f"inference schedule {text!r}: cannot read {part!r}; {FORMS}")
        if key in fields:
            raise ValueError(f"inference schedule {text!r}: {key!r} is given twice")
        fields[key] = parse_mode(value, f"inference schedule {text!r}, part {part!r}")
    for key in ("prefill", "decode"):
        if key not in fields:
            raise ValueError(f"inference schedule {text!r}: missing '{key}=MODE'")
    return PhaseSchedule(**fields)


def _parse_router(text: str, parts) -> RouterSchedule:
    fields = {}
    for part in parts:
        key, _, value = part.partition("=")
        if key not in ("threshold", "budget", "chunk_size") or not value:
            raise ValueError(f"inference schedule {text!r}: cannot read {part!r}; expected 'router threshold=P', "
                             "'router budget=FRACTION' (or both), optionally 'chunk_size=N'")
        try:
            fields[key] = int(value) if key == "chunk_size" else float(value)
        except ValueError:
            raise ValueError(f"inference schedule {text!r}: {key}={value!r} is not a number") from None
    return RouterSchedule(**fields)


def _parse_span(text: str, part: str) -> Span:
    match = _SPAN.match(part)
    if match is None:
        raise ValueError(f"inference schedule {text!r}: cannot read span {part!r}; expected MODE:START-END or MODE:START-")
    mode, start, end = match.groups()
    return Span(parse_mode(mode, f"inference schedule {text!r}, span {part!r}"), int(start), int(end) if end else None)


def as_inference_schedule(schedule: Union[InferenceSchedule, ModeSchedule, str]) -> InferenceSchedule:
    """An InferenceSchedule from itself, a data-layer ModeSchedule or a CLI string."""
    if isinstance(schedule, InferenceSchedule):
        return schedule
    if isinstance(schedule, ModeSchedule):
        return PositionSchedule(schedule)
    if isinstance(schedule, str):
        return parse_schedule(schedule)
    raise TypeError(f"schedule must be an InferenceSchedule, a ModeSchedule or a string, got {type(schedule).__name__}")
