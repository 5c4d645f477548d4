"""Mode schedules: which mixer each token reads with.

A schedule's ``sample_modes(seq_len, sample_index, seed)`` gives the int8 per-token modes of
one training sample. Modes are a pure function of those three numbers, drawn from a
counter-based generator seeded with ``[seed, sample_index]``, so every rank and every
resumed run derives the same modes without communication. (Inference applies the same
schedules to the positions of a prompt and its continuation: ``data.schedules``.)

Named schedules (``build_mode_schedule({"name": ..., **fields})``, or the text form
``build_mode_schedule("switch_at t=512 before=linear")`` that ``str(schedule)`` writes):

- ``random_chunks(chunk_size=128, p_attention=0.5)``: chunks of ``chunk_size``
  tokens from position 0, each attention with probability ``p_attention`` (training);
- ``all_attention``, ``all_linear``: one mode everywhere;
- ``linear_then_attention(n_last)``: linear, then attention for the last ``n_last`` tokens;
- ``switch_at(t, before, after)``: ``before`` at positions < t, ``after`` from t on;
- ``explicit(chunk_modes, chunk_size=128)``: the given mode for each chunk.
"""

import dataclasses
import re
from collections.abc import Mapping
from typing import ClassVar, Sequence, Union

import numpy as np
import torch

from oryx_megatron.config import Mode


def parse_mode(value: Union[int, str, Mode], where: str) -> Mode:
    """A Mode from an int or a name ('linear', 'attention')."""
    try:
        return Mode[value.upper()] if isinstance(value, str) else Mode(value)
    except (KeyError, ValueError):
        names = ", ".join(f"{m.name.lower()} ({m.value})" for m in Mode)
        raise ValueError(f"{where}: unknown mode {value!r}; modes are {names}") from None


def check_int(value, minimum: int, where: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError(f"{where} must be an integer >= {minimum}, got {value!r}")


class ModeSchedule:
    """Base class: subclasses are frozen dataclasses with a registry ``name``."""

    name: ClassVar[str]

    def sample_modes(self, seq_len: int, sample_index: int = 0, seed: int = 0) -> np.ndarray:
        """The modes of global sample ``sample_index`` of a run seeded ``seed``, int8 [seq_len]."""
        raise NotImplementedError

    def batch(self, seq_len: int, sample_indices: Sequence[int], seed: int = 0) -> torch.Tensor:
        """Modes for a batch of global sample indices, int8 [len(sample_indices), seq_len]."""
        return torch.from_numpy(np.stack([self.sample_modes(seq_len, i, seed) for i in sample_indices]))

    def __str__(self):
        """The text form ``build_mode_schedule`` reads back: the name, then FIELD=VALUE per field."""
        return " ".join([self.name] + [f"{f.name}={_format(getattr(self, f.name))}" for f in dataclasses.fields(self)])


@dataclasses.dataclass(frozen=True)
class RandomChunks(ModeSchedule):
    name = "random_chunks"
    chunk_size: int = 128
    p_attention: float = 0.5

    def __post_init__(self):
        check_int(self.chunk_size, 1, "random_chunks.chunk_size")
        if not 0.0 <= self.p_attention <= 1.0:
            raise ValueError(f"random_chunks.p_attention must be in [0, 1], got {self.p_attention!r}")

    def sample_modes(self, seq_len, sample_index=0, seed=0):
        n_chunks = -(-seq_len // self.chunk_size)
        draws = np.random.default_rng([seed, sample_index]).random(n_chunks)
        chunk_modes = np.where(draws < self.p_attention, Mode.ATTENTION, Mode.LINEAR).astype(np.int8)
        return np.repeat(chunk_modes, self.chunk_size)[:seq_len]


@dataclasses.dataclass(frozen=True)
class AllAttention(ModeSchedule):
    name = "all_attention"

    def sample_modes(self, seq_len, sample_index=0, seed=0):
        return np.full(seq_len, Mode.ATTENTION, np.int8)


@dataclasses.dataclass(frozen=True)
class AllLinear(ModeSchedule):
    name = "all_linear"

    def sample_modes(self, seq_len, sample_index=0, seed=0):
        return np.full(seq_len, Mode.LINEAR, np.int8)


@dataclasses.dataclass(frozen=True)
class SwitchAt(ModeSchedule):
    name = "switch_at"
    t: int
    before: Mode = Mode.LINEAR
    after: Mode = Mode.ATTENTION

    def __post_init__(self):
        check_int(self.t, 0, "switch_at.t")
        object.__setattr__(self, "before", parse_mode(self.before, "switch_at.before"))
        object.__setattr__(self, "after", parse_mode(self.after, "switch_at.after"))

    def sample_modes(self, seq_len, sample_index=0, seed=0):
        return np.where(np.arange(seq_len) < self.t, self.before, self.after).astype(np.int8)


@dataclasses.dataclass(frozen=True)
class LinearThenAttention(ModeSchedule):
    """The paper's mixed mode: context in linear mode, the last ``n_last`` tokens in attention."""

    name = "linear_then_attention"
    n_last: int

    def __post_init__(self):
        check_int(self.n_last, 0, "linear_then_attention.n_last")

    def sample_modes(self, seq_len, sample_index=0, seed=0):
        return SwitchAt(max(seq_len - self.n_last, 0)).sample_modes(seq_len)


@dataclasses.dataclass(frozen=True)
class Explicit(ModeSchedule):
    """One mode per chunk; sequences longer than the list are an error, shorter ones a prefix."""

    name = "explicit"
    chunk_modes: tuple
    chunk_size: int = 128

    def __post_init__(self):
        check_int(self.chunk_size, 1, "explicit.chunk_size")
        if isinstance(self.chunk_modes, (str, bytes)) or not isinstance(self.chunk_modes, Sequence) or not self.chunk_modes:
            raise ValueError(f"explicit.chunk_modes must be a non-empty list of modes, got {self.chunk_modes!r}")
        modes = tuple(parse_mode(m, f"explicit.chunk_modes[{i}]") for i, m in enumerate(self.chunk_modes))
        object.__setattr__(self, "chunk_modes", modes)

    def sample_modes(self, seq_len, sample_index=0, seed=0):
        covered = len(self.chunk_modes) * self.chunk_size
        if seq_len > covered:
            raise ValueError(
                f"explicit schedule covers {len(self.chunk_modes)} chunks x {self.chunk_size} = {covered} tokens, "
                f"shorter than seq_len {seq_len}"
            )
        return np.repeat(np.array(self.chunk_modes, np.int8), self.chunk_size)[:seq_len]


class SampleModes(ModeSchedule):
    """Given modes of given samples: sample index i reads row i of ``modes`` [n, seq_len] (seed unused). Not a
    named schedule: it holds the modes of one set of samples (an eval's oracle, a baseline computed per sample);
    ``label`` is its text form."""

    name = "sample_modes"

    def __init__(self, modes: np.ndarray, label: str):
        self.modes, self.label = np.asarray(modes, np.int8), label

    def sample_modes(self, seq_len, sample_index=0, seed=0):
        if seq_len > self.modes.shape[1]:
            raise ValueError(f"{self.label}: modes of {self.modes.shape[1]} positions, asked for {seq_len}")
        return self.modes[sample_index, :seq_len]

    def __str__(self):
        return self.label


SCHEDULES = {cls.name: cls for cls in (RandomChunks, AllAttention, AllLinear, SwitchAt, LinearThenAttention, Explicit)}

# Lower-case constructors, as the schedules are named in configs and docs.
random_chunks, all_attention, all_linear = RandomChunks, AllAttention, AllLinear
switch_at, linear_then_attention, explicit = SwitchAt, LinearThenAttention, Explicit


def _format(value) -> str:
    """A field value as the text form writes it: modes by name, lists as [a,b,c]."""
    if isinstance(value, Mode):
        return value.name.lower()
    if isinstance(value, (tuple, list)):
        return "[" + ",".join(map(_format, value)) + "]"
    return str(value)


def _read_value(text: str):
    """'[a,b]' -> a tuple of values; else an int, a float or the string itself."""
    if text.startswith("[") and text.endswith("]"):
        return tuple(_read_value(item.strip()) for item in text[1:-1].split(",") if item.strip())
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


# Spaces and commas separate the parts of the text form, except inside [...].
_SEPARATOR = re.compile(r"[\s,]+(?![^\[]*\])")


def _read_text(text: str) -> dict:
    """'switch_at t=512, before=linear' -> {"name": "switch_at", "t": 512, "before": "linear"}."""
    name, *parts = [p for p in _SEPARATOR.split(text.strip()) if p] or [None]
    fields = {"name": name}
    for part in parts:
        key, _, value = part.partition("=")
        if not key or not value:
            raise ValueError(f"mode schedule {text!r}: cannot read {part!r}; expected FIELD=VALUE")
        if key in fields:
            raise ValueError(f"mode schedule {text!r}: {key!r} is given twice")
        fields[key] = _read_value(value)
    return fields


def build_mode_schedule(config=None) -> ModeSchedule:
    """A schedule from a config: a ModeSchedule, a mapping or a dataclass with a ``name`` field
    plus the schedule's fields, or the text form (a name, then FIELD=VALUE per field:
    ``"linear_then_attention n_last=64"``); None gives the training default ``random_chunks()``."""
    if config is None:
        return RandomChunks()
    if isinstance(config, ModeSchedule):
        return config
    if isinstance(config, str):
        config = _read_text(config)
    elif dataclasses.is_dataclass(config):
        config = dataclasses.asdict(config)
    elif not isinstance(config, Mapping):
        raise TypeError(f"mode schedule config must be a mapping, a string or a ModeSchedule, got {type(config).__name__}")
    fields = dict(config)
    name = fields.pop("name", None)
    if name not in SCHEDULES:
        raise ValueError(f"mode schedule name {name!r} is unknown; choose one of {', '.join(SCHEDULES)}")
    cls = SCHEDULES[name]
    known = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(fields) - set(known))
    if unknown:
        raise ValueError(f"mode schedule {name!r} has no field {unknown[0]!r}; its fields are: {', '.join(known) or 'none'}")
    missing = [f.name for f in dataclasses.fields(cls) if f.name not in fields and f.default is dataclasses.MISSING]
    if missing:
        raise ValueError(f"mode schedule {name!r} needs field {missing[0]!r}")
    return cls(**fields)
