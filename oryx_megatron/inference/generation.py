"""Batched generation with the Oryx inference cache.

Prompts of different lengths share one cache without padding: the shortest prompt length
is prefilled for the whole batch in one parallel forward, then every sequence advances one
position per step. A sequence still inside its prompt feeds its next prompt token (teacher
forcing; its logits are unused), the others feed their last sampled token. All caches stay
at the same position, so no attention mask and no padding token enter the states.

Two pieces: ``schedule_prompts`` lays the ragged prompts out with the mode of every position
(``RaggedBatch``, with a host copy of the modes); ``generate`` prefills, then steps the batch,
sampling for the sequences past their prompts (``_Sequences``).

The caches are static: allocated once for the longest prompt plus ``max_new_tokens``, updated
in place. A call whose tokens all read one mode passes that ``Mode`` (the model then computes
only that mixer); the host copy of the modes decides it, so a step syncs with the device only
to read the sampled tokens. On CUDA the one-token steps replay CUDA graphs (``cuda_graphs``).
``kv_cache=False`` keeps no keys/values: linear-only generation, checked before any compute.
The Transformer baseline decodes through megatron's own KV cache (``models.transformer``): attention
only, eagerly.

A sequence finishes on a stop token (kept as its last output token, reason "stop") or after
``max_new_tokens`` (reason "length"). Finished sequences keep stepping with the batch, their
outputs frozen and their tokens left out of the stats, until every sequence is done.

The mode of position t of a sequence comes from the schedule (see ``schedules``); both
memories absorb every token whatever its mode.
"""

import dataclasses
import time
from typing import Dict, List, Optional, Sequence

import numpy as np
import torch
from torch import Tensor

from oryx_megatron.config import Mode
from oryx_megatron.data.schedules import InferenceSchedule, RouterSchedule, as_inference_schedule
from oryx_megatron.inference.cuda_graphs import decode_step, use_cuda_graphs
from oryx_megatron.inference.forward import (
    cached_logits, check_model, eval_mode, mode_arg, prompt_documents, reset_documents,
)
from oryx_megatron.inference.routing import ChunkDecisions, chunk_decisions
from oryx_megatron.inference.sampling import Sampler, SamplingParams
from oryx_megatron.models.transformer import TransformerBaseline

NO_KV_CACHE = "no KV cache (kv_cache=False / --no-kv-cache)"  # what a linear-only cache cannot read


@dataclasses.dataclass
class GenerationStats:
    tokens_per_mode: Dict[str, int]  # tokens fed to the model by live sequences, by read mode
    prefill_tokens: int  # batch x shortest prompt, one parallel forward
    prefill_seconds: float
    decode_tokens: int  # tokens fed by live sequences after the prefill (generated tokens but the last, prompt tails)
    decode_seconds: float  # CUDA-graph captures excluded (capture_seconds)
    cache_bytes: Dict[str, int]  # kv / recurrent / conv, all layers, allocated
    capture_seconds: float = 0.0  # capturing the CUDA graphs of the decode steps
    capture_error: Optional[str] = None  # a capture that raised: the steps after it decoded eagerly
    drafted: int = 0  # speculative decoding: tokens drafted in linear mode
    accepted: int = 0  # ... and accepted by the attention-mode verification

    @property
    def attention_fraction(self) -> float:
        return self.tokens_per_mode["attention"] / max(sum(self.tokens_per_mode.values()), 1)

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.prefill_tokens / max(self.prefill_seconds, 1e-9)

    @property
    def decode_tokens_per_s(self) -> float:
        return self.decode_tokens / max(self.decode_seconds, 1e-9)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / max(self.drafted, 1)


@dataclasses.dataclass
class GenerationResult:
    tokens: List[List[int]]  # generated ids per prompt
    finish_reasons: List[str]  # "stop" | "length"
    stats: GenerationStats
    logits: Optional[List[Tensor]] = None  # per prompt [len(tokens[i]), vocab]: the logits each token came from


@dataclasses.dataclass
class RaggedBatch:
    """Prompts of different lengths laid out for lock-step decoding (see the module docstring)."""

    tokens: Tensor  # [b, span + 1] long: each prompt, then room for its generated tokens
    modes: Tensor  # [b, span] int8: the mode of every position ever fed; past its end a sequence repeats its last
    host_modes: np.ndarray  # [b, span] int8: the same, on the host (Mode hints without a device sync)
    prompt_lengths: Tensor  # [b] long, on the device
    lengths: List[int]  # prompt lengths
    max_new_tokens: int
    schedule: InferenceSchedule

    @property
    def prefill_len(self) -> int:
        """Positions every sequence has in its prompt: prefilled in one parallel forward."""
        return min(self.lengths)

    @property
    def capacity(self) -> int:
        """Cache positions to allocate: the longest prompt plus max_new_tokens."""
        return max(self.lengths) + self.max_new_tokens

    def mode_arg(self, start: int, end: int):
        """The modes argument for positions [start, end): a Mode when all read one, else modes [b, end - start]."""
        return mode_arg(self.host_modes[:, start:end], self.modes[:, start:end])

    def set_chunk_modes(self, first: int, modes: Tensor, chunk_size: int) -> None:
        """The modes of chunks first.. (modes [b, k]: a router schedule's decisions) on the device and the host."""
        start, end = first * chunk_size, min((first + modes.shape[1]) * chunk_size, self.modes.shape[1])
        if end > start:
            positions = modes.repeat_interleave(chunk_size, dim=1)[:, : end - start]
            self.modes[:, start:end] = positions
            self.host_modes[:, start:end] = positions.cpu().numpy()  # the one host sync of a decision

    def require_reads(self, mode: Mode, who: str) -> None:
        """Refuse (before any compute) a schedule that makes a token read another mode than ``mode``: ``who``
        (the start of the message) cannot read it."""
        name = mode.name.lower()
        advice = f"use {'an' if name[0] in 'aeiou' else 'a'} {name}-only schedule such as all_{name}"
        if isinstance(self.schedule, RouterSchedule):
            raise ValueError(f"{who}: schedule '{self.schedule}' lets the router choose each chunk's mode; {advice}")
        elsewhere = self.host_modes != mode  # [b, span]
        if elsewhere.any():
            i, pos = np.argwhere(elsewhere)[0]
            raise ValueError(f"{who}: schedule '{self.schedule}' makes position {pos} of prompt {i} read "
                             f"{Mode(int(self.host_modes[i, pos])).name.lower()}; {advice}")


def schedule_prompts(prompts: Sequence[Sequence[int]], schedule, max_new_tokens: int, vocab_limit: int,
                     device: torch.device, max_length: Optional[int] = None) -> RaggedBatch:
    """Validate the prompts and lay them out with the schedule's mode of every position.
    ``max_length`` (the model's max_sequence_length): a prompt plus max_new_tokens must fit it."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("prompts must be a non-empty list of non-empty token lists")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
    schedule = as_inference_schedule(schedule)
    lengths = [len(p) for p in prompts]
    if max_length is not None and max(lengths) + max_new_tokens > max_length:
        raise ValueError(f"a prompt of {max(lengths)} tokens + max_new_tokens {max_new_tokens} = "
                         f"{max(lengths) + max_new_tokens} exceeds max_sequence_length {max_length}")
    span = max(lengths) + max_new_tokens - 1  # positions ever fed
    tokens = torch.zeros(len(prompts), span + 1, dtype=torch.long)
    for i, prompt in enumerate(prompts):
        tokens[i, : len(prompt)] = torch.as_tensor(prompt, dtype=torch.long)
    bad = tokens[(tokens < 0) | (tokens >= vocab_limit)]
    if bad.numel():
        raise ValueError(f"a prompt holds id {int(bad[0])}, outside [0, vocab_size={vocab_limit})")
    if isinstance(schedule, RouterSchedule):  # decided chunk by chunk as decoding goes (``_decode``)
        modes = np.full((len(prompts), span), Mode.LINEAR, np.int8)
    else:
        modes = np.stack([
            np.pad(schedule.position_modes(n, n + max_new_tokens - 1), (0, span - n - max_new_tokens + 1), mode="edge")
            for n in lengths
        ])
    return RaggedBatch(tokens.to(device), torch.from_numpy(modes).to(device), modes,
                       torch.tensor(lengths, device=device), lengths, max_new_tokens, schedule)


class _Sequences:
    """What decoding has produced so far: each sequence's output tokens (and logits), why it finished,
    and the tokens fed by live sequences per mode (host-side bookkeeping)."""

    def __init__(self, batch: RaggedBatch, sampler: Sampler, stop_token_ids: Sequence[int], output_logits: bool):
        self.batch, self.sampler, self.stop = batch, sampler, set(stop_token_ids)
        b = len(batch.lengths)
        self.tokens: List[List[int]] = [[] for _ in range(b)]
        self.logits: Optional[List[List[Tensor]]] = [[] for _ in range(b)] if output_logits else None
        self.reasons: List[Optional[str]] = [None] * b
        self.fed = np.zeros(len(Mode), np.int64)

    def live(self) -> List[bool]:
        return [r is None for r in self.reasons]

    def count_fed(self, start: int, end: int) -> None:
        """Positions [start, end) were fed: count the live sequences' tokens by mode."""
        self.fed += np.bincount(self.batch.host_modes[self.live(), start:end].ravel(), minlength=len(Mode))

    def emit(self, pos: int, logits: Tensor) -> None:
        """Sample position ``pos`` of every live sequence past its prompt from logits [b, V].
        The sampled ids enter batch.tokens on the device; reading them is the step's one host sync."""
        batch = self.batch
        emit = [i for i, live in enumerate(self.live()) if live and pos >= batch.lengths[i]]
        if not emit:
            return
        sampled = self.sampler(logits)  # [b]; rows inside their prompt keep their prompt token
        batch.tokens[:, pos] = torch.where(batch.prompt_lengths <= pos, sampled, batch.tokens[:, pos])
        host = sampled.tolist()
        for i in emit:
            token = host[i]
            self.tokens[i].append(token)
            if self.logits is not None:
                self.logits[i].append(logits[i].clone())
            if token in self.stop:
                self.reasons[i] = "stop"
            elif len(self.tokens[i]) == batch.max_new_tokens:
                self.reasons[i] = "length"


def generate(
    model: torch.nn.Module,
    prompts: Sequence[Sequence[int]],
    schedule,
    max_new_tokens: int,
    sampling: SamplingParams = SamplingParams(),
    stop_token_ids: Sequence[int] = (),
    vocab_size: Optional[int] = None,
    output_logits: bool = False,
    kv_cache: bool = True,
    cuda_graphs: Optional[bool] = None,
    reset_at_eod: Optional[int] = None,
    prefill_chunk: Optional[int] = None,
) -> GenerationResult:
    """Continue each prompt by up to ``max_new_tokens`` tokens.

    schedule: an InferenceSchedule, a data-layer ModeSchedule or a CLI string
    (``schedules.parse_schedule``); vocab_size: the tokenizer's, ids at or above it
    (the padded vocab) are never sampled. kv_cache=False: keep no keys/values (the schedule
    must read linear everywhere). cuda_graphs: replay the one-token steps from CUDA graphs
    (None: on CUDA devices). reset_at_eod: the EOD id of a model trained with data.reset_at_eod:
    after each EOD token (in the prompt or generated) every state restarts and attention reads
    only the new document, as in training. prefill_chunk: prefill this many tokens at a time, each
    continuing the caches (None: the whole prefill at once): at any prompt length the activations stay
    those of one chunk, the KV cache holding every token (long contexts; the logits do not change). The
    model runs in eval mode, then gets its training flag back.
    """
    if prefill_chunk is not None and prefill_chunk < 1:
        raise ValueError(f"prefill_chunk must be >= 1, got {prefill_chunk}")
    device, dtype = check_model(model)
    limit = vocab_size if vocab_size is not None else model.vocab_size  # the padded vocab
    batch = schedule_prompts(prompts, schedule, max_new_tokens, limit, device)
    if not kv_cache:
        batch.require_reads(Mode.LINEAR, NO_KV_CACHE)
    if isinstance(model, TransformerBaseline):  # megatron's KV cache, read eagerly
        batch.require_reads(Mode.ATTENTION, "the Transformer baseline reads attention only")
        if cuda_graphs:
            raise ValueError("cuda_graphs=True: the Transformer baseline decodes eagerly (megatron's KV cache), "
                             "without CUDA graphs")
        cuda_graphs = False
    graphs = use_cuda_graphs(cuda_graphs, device)
    sequences = _Sequences(batch, Sampler(sampling, vocab_size, device), stop_token_ids, output_logits)
    b = len(batch.lengths)
    routed = isinstance(batch.schedule, RouterSchedule)
    with eval_mode(model):
        decisions = chunk_decisions(model, batch.schedule, b, device) if routed else None
        cache = model.allocate_inference_cache(b, dtype, device, capacity=batch.capacity, kv_cache=kv_cache)
        router_cache = model.allocate_router_cache(b, dtype, device, capacity=batch.capacity) if routed else None
        prefill_seconds, decode_seconds, step = _decode(model, batch, sequences, cache, graphs, reset_at_eod,
                                                        decisions, prefill_chunk, router_cache)

    counts = {m.name.lower(): int(n) for m, n in zip(Mode, sequences.fed)}
    stats = GenerationStats(
        tokens_per_mode=counts,
        prefill_tokens=b * batch.prefill_len,
        prefill_seconds=prefill_seconds,
        decode_tokens=sum(counts.values()) - b * batch.prefill_len,
        decode_seconds=decode_seconds,
        cache_bytes=cache_bytes(cache),
        capture_seconds=getattr(step, "capture_seconds", 0.0),
        capture_error=getattr(step, "capture_error", None),
    )
    logits_out = [torch.stack(rows) for rows in sequences.logits] if output_logits else None
    return GenerationResult(sequences.tokens, sequences.reasons, stats, logits_out)


def _decode(model, batch: RaggedBatch, sequences: _Sequences, cache, cuda_graphs: bool, eod_id: Optional[int],
            decisions: Optional[ChunkDecisions], prefill_chunk: Optional[int], router_cache=None):
    """Prefill, then one-token steps until every sequence is done: (prefill seconds, decode seconds, the
    decode step: its graph capture's seconds and error, if any).
    With ``decisions`` (a router schedule) the chunks up to the prefill's end are decided from one routing
    pass over the prefill, each later one at its first position, from that token (``OryxModel.route_step``);
    a router of more than one layer reads the all-linear pass of ``router_cache``, which every token advances."""
    device, t0 = batch.tokens.device, batch.prefill_len
    start = time.perf_counter()
    prompt = batch.tokens[:, :t0]
    if decisions is not None:
        logits = model.route(prompt, decisions.chunk_size, prompt_documents(prompt, eod_id), router_cache)  # [b, chunks]
        batch.set_chunk_modes(0, decisions(logits), decisions.chunk_size)
    logits = _prefill(model, batch, cache, eod_id, prefill_chunk or t0)  # [b, V]
    sequences.count_fed(0, t0)
    prefill_seconds, start = elapsed(start, device), time.perf_counter()
    step = decode_step(model, cache, cuda_graphs)
    pos = t0  # the position predicted by `logits`
    while True:
        sequences.emit(pos, logits)
        if not any(sequences.live()):
            break
        reset_documents(cache + (router_cache or []), batch.tokens[:, pos - 1], eod_id)
        token = batch.tokens[:, pos : pos + 1]
        if decisions is not None and pos % decisions.chunk_size == 0 and pos // decisions.chunk_size == decisions.decided:
            chunk_logits = model.route_step(token, cache, router_cache)  # [b, 1]: from the chunk's first token
            batch.set_chunk_modes(decisions.decided, decisions(chunk_logits), decisions.chunk_size)
        elif router_cache is not None:
            model.advance_router(token, router_cache)
        logits = step(batch.tokens[:, pos : pos + 1], batch.mode_arg(pos, pos + 1))
        sequences.count_fed(pos, pos + 1)
        pos += 1
    return prefill_seconds, elapsed(start, device) - getattr(step, "capture_seconds", 0.0), step


def _prefill(model, batch: RaggedBatch, cache, eod_id: Optional[int], chunk: int) -> Tensor:
    """The first ``prefill_len`` positions of every prompt through the caches, ``chunk`` at a time (each chunk
    continues the caches, its documents restarted after an EOD that ended the chunk before): the logits [b, V]
    of the last position."""
    for start in range(0, batch.prefill_len, chunk):
        end = min(start + chunk, batch.prefill_len)
        if start:
            reset_documents(cache, batch.tokens[:, start - 1], eod_id)
        ids = batch.tokens[:, start:end]
        logits = cached_logits(model, ids, batch.mode_arg(start, end), cache, last_only=True,
                               document_ids=prompt_documents(ids, eod_id))
    return logits[:, -1]


def cache_bytes(caches) -> Dict[str, int]:
    """Allocated bytes of the caches of every layer: kv / recurrent / conv."""
    return {key: sum(c.nbytes()[key] for c in caches) for key in ("kv", "recurrent", "conv")}


def elapsed(start: float, device: torch.device) -> float:
    """Seconds since ``start``, once the device has finished its queued work."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start
