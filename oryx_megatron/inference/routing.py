"""Router schedules applied: each chunk's mode from the model's router, decided in order, causally.

The router's logit of chunk c reads only the chunk's first token and the tokens before it
(mixer/router.py), and ``ChunkDecisions`` decides chunk c from that logit and the decisions before
it (the budget's quota), never from later logits: changing tokens after a chunk's first token never
changes its decision. A parallel pass (``route_modes``: training-style batches, eval tasks, a prompt's
prefill) decides every chunk of a sequence at once; generation decides each later chunk at its first
token, before that token's step (``OryxModel.route_step``): one host sync per chunk.
"""

from typing import Optional

import torch
from torch import Tensor

from oryx_megatron.config import Mode
from oryx_megatron.data.schedules import RouterSchedule
from oryx_megatron.mixer.router import ROUTER_THRESHOLD


class ChunkDecisions:
    """The decisions of a RouterSchedule for a batch, chunk after chunk (see RouterSchedule)."""

    def __init__(self, model, schedule: RouterSchedule, batch_size: int, device):
        if getattr(model, "router", None) is None:
            raise ValueError(f"schedule '{schedule}' needs a model with a router (router.hidden); "
                             "this one has none")
        router = model.router
        self.chunk_size = schedule.chunk_size or model.config.router.chunk_size
        self.threshold = schedule.threshold
        if self.threshold is None:  # a budget alone: its calibrated quantile (if any), at least the router's own 0.5
            self.threshold = max(ROUTER_THRESHOLD, router.budget_threshold(schedule.budget) or 0.0)
        self.budget = schedule.budget
        self.used = torch.zeros(batch_size, dtype=torch.long, device=device)  # chunks that read attention
        self.decided = 0  # chunks decided so far

    def __call__(self, logits: Tensor) -> Tensor:
        """The modes [b, k] (int8) of the next k chunks from their logits [b, k]."""
        attend = torch.sigmoid(logits.float()) >= self.threshold  # [b, k]
        modes = []
        for j in range(logits.shape[1]):
            want = attend[:, j]
            if self.budget is not None:
                want = want & (self.used + 1 <= self.budget * (self.decided + 1) + 1)
            self.used += want
            self.decided += 1
            modes.append(torch.where(want, Mode.ATTENTION, Mode.LINEAR))
        return torch.stack(modes, dim=1).to(torch.int8)


def route_modes(model, schedule: RouterSchedule, tokens: Tensor, document_ids: Optional[Tensor] = None) -> Tensor:
    """The modes [b, s] (int8) a router schedule gives tokens [b, s] (one parallel routing pass)."""
    decisions = ChunkDecisions(model, schedule, tokens.shape[0], tokens.device)
    chunk, s = decisions.chunk_size, tokens.shape[1]
    logits = model.route(tokens, chunk, document_ids)  # [b, ceil(s / chunk)]
    return decisions(logits).repeat_interleave(chunk, dim=1)[:, :s]
