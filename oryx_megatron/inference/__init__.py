"""Inference: mode schedules for prompts and continuations, sampling, batched generation with
static caches (CUDA graphs on GPU), self-speculative decoding."""

from oryx_megatron.data.schedules import (
    ALL_ATTENTION,
    ALL_LINEAR,
    LINEAR_PREFILL,
    InferenceSchedule,
    PhaseSchedule,
    PositionSchedule,
    Span,
    SpanSchedule,
    as_inference_schedule,
    parse_schedule,
)
from oryx_megatron.inference.generation import GenerationResult, GenerationStats, generate
from oryx_megatron.inference.speculative import accept_drafts, speculative_generate
from oryx_megatron.inference.sampling import Sampler, SamplingParams

__all__ = [
    "ALL_ATTENTION", "ALL_LINEAR", "LINEAR_PREFILL", "GenerationResult", "GenerationStats",
    "InferenceSchedule", "PhaseSchedule", "PositionSchedule", "Sampler", "SamplingParams", "Span",
    "SpanSchedule", "accept_drafts", "as_inference_schedule", "generate", "parse_schedule", "speculative_generate",
]
