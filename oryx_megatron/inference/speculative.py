"""Self-speculative decoding: the model's linear mode drafts, its attention mode verifies.

One Oryx model holds both memories for every token, so it is its own draft model: after the
prompt is prefilled (with the schedule's modes on the prompt), each round

1. snapshots the caches, then drafts k tokens d_1..d_k with one-token steps reading
   Mode.LINEAR (q_i: the draft distributions);
2. restores the snapshot and runs ONE parallel forward over [x, d_1..d_k] (x: the last accepted
   token, not yet fed) reading Mode.ATTENTION: the target distributions p_1..p_{k+1}, and the
   caches as attention-mode decoding would leave them;
3. accepts d_i with probability min(1, p_i(d_i) / q_i(d_i)) in order; at the first rejection
   (position j) draws the next token from normalize(max(0, p_j - q_j)), and when every draft is
   accepted draws a bonus token from p_{k+1} (greedy: accept while argmax p_i == d_i, then the
   argmax of p);
4. after a rejection the caches hold k + 1 tokens of which only x, d_1..d_{j-1} stand: they are
   restored to the snapshot and the accepted tokens are fed again in one attention-mode forward
   (exact; one extra pass, only on rejection).

p and q are the distributions after the sampling transforms (``Sampler.probs``: temperature,
top-k, top-p; one-hot argmax when greedy), so the output is distributed exactly as attention-mode
decoding (the target) with the same sampling; greedy output equals it token for token. The
target is the schedule's modes on the prompt, then attention on every generated token
(``prefill=MODE decode=attention``). Batch 1 only.
"""

import time
from typing import List, Optional, Sequence, Tuple

import numpy as np
import torch
from torch import Tensor

from oryx_megatron.config import Mode
from oryx_megatron.data.schedules import RouterSchedule
from oryx_megatron.inference.cuda_graphs import StepFn, decode_step, use_cuda_graphs
from oryx_megatron.inference.forward import (
    cached_logits, check_model, eval_mode, prompt_documents, reset_documents, restore, snapshot,
)
from oryx_megatron.inference.generation import (
    GenerationResult,
    GenerationStats,
    cache_bytes,
    elapsed,
    schedule_prompts,
)
from oryx_megatron.inference.routing import chunk_decisions
from oryx_megatron.inference.sampling import Sampler, SamplingParams
from oryx_megatron.models.transformer import TransformerBaseline


def accept_drafts(p: Tensor, q: Tensor, drafts: Tensor, sampler: Sampler) -> Tuple[int, int]:
    """The speculative-sampling rule: p [k + 1, V] target, q [k, V] draft distributions, drafts [k]
    drawn from q. Returns (n accepted drafts, the next token: the residual draw after a rejection,
    else the bonus draw from p[k])."""
    k = drafts.shape[0]
    rows = torch.arange(k, device=p.device)
    ratio = p[rows, drafts] / q[rows, drafts]  # [k]
    u = torch.rand(k, generator=sampler.generator, device=p.device, dtype=ratio.dtype)
    n = int((u < ratio).long().cumprod(0).sum())  # host sync: the accepted prefix
    if n == k:
        return n, int(sampler.draw(p[k : k + 1]))
    residual = (p[n] - q[n]).clamp(min=0)
    residual = torch.where(residual.sum() > 0, residual, p[n])  # p == q: a rejection only by rounding
    return n, int(sampler.draw(residual[None]))


class _Speculator:
    """Rounds of draft (linear) and verify (attention) over the caches of one sequence."""

    def __init__(self, model, caches, sampler: Sampler, step: StepFn):
        self.model, self.caches, self.sampler, self.step = model, caches, sampler, step
        self.fed = {Mode.LINEAR: 0, Mode.ATTENTION: 0}
        self.drafted = self.accepted = 0

    def round(self, last: int, k: int) -> Tuple[List[int], Tensor]:
        """Drafts k tokens after ``last`` and verifies them: (the new tokens, 1 to k + 1 of them,
        and the target logits each came from [n, V])."""
        saved = snapshot(self.caches)
        ids = torch.tensor([[last]], device=self.caches[0].position.device)  # [1, 1]
        drafts, q = self._draft(ids, k)  # [k], k x [1, V]
        restore(self.caches, saved)
        ids = torch.cat([ids, drafts[None]], dim=1)  # [1, k + 1]
        logits = self._attend(ids)  # [k + 1, V]
        p = self.sampler.probs(logits)
        n, token = accept_drafts(p, torch.cat(q) if q else p[:0], drafts, self.sampler)
        if n < k:  # keep only x, d_1..d_n in the caches
            restore(self.caches, saved)
            self._attend(ids[:, : n + 1])
        self.drafted, self.accepted = self.drafted + k, self.accepted + n
        return drafts[:n].tolist() + [token], logits[: n + 1]

    def _draft(self, ids: Tensor, k: int) -> Tuple[Tensor, List[Tensor]]:
        """k one-token linear-mode steps from ids [1, 1]: drafts [k] and their distributions k x [1, V]."""
        drafts, q = [ids.new_zeros(0)], []
        for _ in range(k):
            probs = self.sampler.probs(self.step(ids, Mode.LINEAR))  # [1, V]
            ids = self.sampler.draw(probs)[None]  # [1, 1], stays on the device
            drafts.append(ids[0])
            q.append(probs)
        self.fed[Mode.LINEAR] += k
        return torch.cat(drafts), q

    def _attend(self, ids: Tensor) -> Tensor:
        """Feed ids [1, n] reading attention: logits [n, V]."""
        self.fed[Mode.ATTENTION] += ids.shape[1]
        return cached_logits(self.model, ids, Mode.ATTENTION, self.caches)[0]

def speculative_generate(
    model: torch.nn.Module,
    prompts: Sequence[Sequence[int]],
    schedule,
    max_new_tokens: int,
    speculative_tokens: int = 4,
    sampling: SamplingParams = SamplingParams(),
    stop_token_ids: Sequence[int] = (),
    vocab_size: Optional[int] = None,
    output_logits: bool = False,
    cuda_graphs: Optional[bool] = None,
    reset_at_eod: Optional[int] = None,
) -> GenerationResult:
    """``generate`` for one prompt by self-speculative decoding with k = ``speculative_tokens`` drafts
    per round (see the module docstring). The schedule gives the prompt's modes (a router schedule:
    its decisions for the prompt's chunks); every generated token reads attention. Stats add
    ``drafted`` and ``accepted``; tokens_per_mode counts every token fed, drafts and re-fed tokens
    included. reset_at_eod (as ``generate``'s): the prompt's documents reset the states; a generated
    EOD ends the output (a stop token)."""
    if len(prompts) != 1:
        raise ValueError(f"speculative decoding supports batch 1 (one prompt), got {len(prompts)} prompts")
    k = speculative_tokens
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"speculative_tokens must be an integer >= 1, got {k!r}")
    if isinstance(model, TransformerBaseline):
        raise ValueError("speculative decoding drafts in linear mode: the Transformer baseline reads attention only")
    device, dtype = check_model(model)
    graphs = use_cuda_graphs(cuda_graphs, device)
    limit = vocab_size if vocab_size is not None else model.vocab_size
    batch = schedule_prompts(prompts, schedule, max_new_tokens, limit, device)
    n = batch.lengths[0]
    sampler, stop = Sampler(sampling, vocab_size, device), set(stop_token_ids) | {reset_at_eod} - {None}
    with eval_mode(model):
        caches = model.allocate_inference_cache(1, dtype, device, capacity=batch.capacity)
        start = time.perf_counter()
        prompt = batch.tokens[:, :n]
        documents = prompt_documents(prompt, reset_at_eod)
        if isinstance(batch.schedule, RouterSchedule):  # the prompt's chunks as the router decides them
            decisions = chunk_decisions(model, batch.schedule, 1, device)
            batch.set_chunk_modes(0, decisions(model.route(prompt, decisions.chunk_size, documents)),
                                  decisions.chunk_size)
        first = cached_logits(model, prompt, batch.mode_arg(0, n), caches, last_only=True,
                              document_ids=documents)[0]  # [1, V]
        reset_documents(caches, prompt[:, -1], reset_at_eod)  # a prompt ending in EOD: the output starts a document
        tokens, logits = sampler(first).tolist(), [first]
        prefill_seconds, start = elapsed(start, device), time.perf_counter()
        step = decode_step(model, caches, graphs)
        speculator = _Speculator(model, caches, sampler, step)
        new = tokens
        while not stop.intersection(new) and len(tokens) < max_new_tokens:
            new, new_logits = speculator.round(tokens[-1], min(k, max_new_tokens - len(tokens) - 1))
            tokens += new
            logits.append(new_logits)
        capture_seconds = getattr(step, "capture_seconds", 0.0)
        decode_seconds = elapsed(start, device) - capture_seconds

    tokens, reason = _finish(tokens, stop, max_new_tokens)
    prompt_fed = np.bincount(batch.host_modes[0, :n], minlength=len(Mode))
    stats = GenerationStats(
        tokens_per_mode={m.name.lower(): int(prompt_fed[m]) + speculator.fed[m] for m in Mode},
        prefill_tokens=n,
        prefill_seconds=prefill_seconds,
        decode_tokens=len(tokens) - 1,
        decode_seconds=decode_seconds,
        cache_bytes=cache_bytes(caches),
        capture_seconds=capture_seconds,
        capture_error=getattr(step, "capture_error", None),
        drafted=speculator.drafted,
        accepted=speculator.accepted,
    )
    logits_out = [torch.cat(logits)[: len(tokens)]] if output_logits else None
    return GenerationResult([tokens], [reason], stats, logits_out)


def _finish(tokens: List[int], stop: set, max_new_tokens: int) -> Tuple[List[int], str]:
    """The output up to its first stop token (kept) or max_new_tokens, and the finish reason."""
    for i, token in enumerate(tokens[:max_new_tokens]):
        if token in stop:
            return tokens[: i + 1], "stop"
    return tokens[:max_new_tokens], "length"
