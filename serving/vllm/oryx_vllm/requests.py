"""Per-request mode schedules. A request names its schedule in its sampling parameters,
``SamplingParams(extra_args={"oryx_schedule": "prefill=linear decode=attention"})`` (the OpenAI server's
``"vllm_xargs": {"oryx_schedule": ...}``); a request without one reads the deployment's (``serving_schedule``).

vLLM hands each request's sampling parameters, prompt and batch row to the logits processors before every
forward (``update_state``, after it has put the decodes first), not to the model. ``ScheduleTracker`` is such a
processor that changes no logits: it keeps, per row of the persistent batch, the request's schedule, prompt length
and ``max_tokens`` in ``ROWS``, a table of the worker process that the model reads, row k for the k-th request of
the step. Every schedule text is parsed at admission by the served folder's own parser (``validate_params``):
a bad one is an HTTP 400 naming it, and nothing reaches the engine."""

import importlib
from dataclasses import dataclass, field
from types import ModuleType
from typing import Dict, Optional

import numpy as np
from vllm import SamplingParams
from vllm.v1.sample.logits_processor import LogitsProcessor
from vllm.v1.sample.logits_processor.builtin import process_dict_updates

from oryx_vllm import OryxServingError

EXTRA_ARG = "oryx_schedule"
NEEDS_WHOLE_PROMPT = "router"  # the router reads a prompt's chunks in one pass; vLLM may cut a prompt anywhere


SERVED: Optional[ModuleType] = None  # the schedules module of the Oryx folder this process serves (``serve``)


def serve(config) -> ModuleType:
    """Record, at start-up, the folder whose parser admits requests: the ``oryx_data_schedules`` beside the served
    config's class (its remote-code package). vLLM's admission hook sees a request's parameters only, so the
    record is per process: one engine per process, as vLLM deploys; an engine of another architecture made later
    in the same process would still admit ``oryx_schedule`` with this folder's parser, and ignore it."""
    global SERVED
    SERVED = importlib.import_module(type(config).__module__.rsplit(".", 1)[0] + ".oryx_data_schedules")
    return SERVED


def served_schedules() -> ModuleType:
    if SERVED is None:
        raise OryxServingError(f"oryx-vllm: {EXTRA_ARG} was given but the served model is not an Oryx folder")
    return SERVED


def parse_schedule(text, schedules: ModuleType, where: str = EXTRA_ARG):
    """The InferenceSchedule of ``text``, or one line naming ``where`` and what is not served."""
    if not isinstance(text, str):
        raise OryxServingError(f"oryx-vllm: {where}={text!r}: expected a schedule text")
    try:
        schedule = schedules.as_inference_schedule(text)
    except ValueError as e:
        raise OryxServingError(f"oryx-vllm: {where}={text!r}: {e}") from None
    if isinstance(schedule, schedules.RouterSchedule):
        raise OryxServingError(f"oryx-vllm: {where}={text!r}: router schedules are not served (the router reads a "
                               "prompt's chunks in one pass and vLLM's chunked prefill cuts prompts anywhere)")
    if isinstance(schedule, schedules.SpanSchedule) and schedule.spans[-1].end is not None:
        raise OryxServingError(f"oryx-vllm: {where}={text!r}: the last span must be open-ended (MODE:START-): a "
                               "request may run to max_model_len")
    return schedule


@dataclass
class Row:
    """One request of the batch: its schedule (None: the deployment's), prompt length and token budget."""

    schedule: Optional[str]
    prompt_len: int
    max_tokens: int
    _modes: Optional[np.ndarray] = field(default=None, repr=False)

    def modes(self, schedules: ModuleType, default) -> np.ndarray:
        """int8 modes of every position fed, [prompt_len + max_tokens - 1] as in ``oryx-generate``."""
        if self._modes is None:
            schedule = default if self.schedule is None else parse_schedule(self.schedule, schedules)
            self._modes = schedule.position_modes(self.prompt_len, self.prompt_len + max(self.max_tokens, 1) - 1)
        return self._modes

    def chunk_modes(self, start: int, length: int, schedules: ModuleType, default) -> np.ndarray:
        """int8 modes of the positions start .. start + length - 1 (the last one repeated past the request's end)."""
        modes = self.modes(schedules, default)
        return modes[np.minimum(np.arange(start, start + length), len(modes) - 1)]

    def mode_at(self, position: int, schedules: ModuleType, default) -> int:
        return int(self.chunk_modes(position, 1, schedules, default)[0])


ROWS: Dict[int, Row] = {}  # this worker's persistent batch: row -> Row


class ScheduleTracker(LogitsProcessor):
    """Keeps ``ROWS`` in step with vLLM's persistent batch; the logits are left as they are."""

    @classmethod
    def validate_params(cls, sampling_params: SamplingParams):
        text = (sampling_params.extra_args or {}).get(EXTRA_ARG)
        if text is not None:
            parse_schedule(text, served_schedules())

    def __init__(self, vllm_config, device, is_pin_memory: bool):
        ROWS.clear()
        self.max_model_len = vllm_config.model_config.max_model_len

    def is_argmax_invariant(self) -> bool:
        return True

    def apply(self, logits):
        return logits

    def update_state(self, batch_update) -> None:
        process_dict_updates(ROWS, batch_update, self._row)

    def _row(self, params: SamplingParams, prompt, output) -> Row:
        """The request's row; its token budget stops at max_model_len, where vLLM stops it (the OpenAI server
        lowers ``max_tokens`` to that already), so ``n_last`` counts from where it ends."""
        budget = self.max_model_len - len(prompt)
        return Row((params.extra_args or {}).get(EXTRA_ARG), len(prompt), min(params.max_tokens or budget, budget))
