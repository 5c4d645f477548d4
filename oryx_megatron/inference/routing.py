"""Router schedules applied: each chunk's mode from the model's router, decided in order, causally.

The router's logit of chunk c reads only the chunk's first token and the tokens before it
(mixer/router.py), and ``ChunkDecisions`` decides chunk c from that logit and the decisions before
it (the budget's quota), never from later logits: changing tokens after a chunk's first token never
changes its decision. A parallel pass (``route_modes``: training-style batches, eval tasks, a prompt's
prefill) decides every chunk of a sequence at once; generation decides each later chunk at its first
token, before that token's step (``OryxModel.route_step``): one host sync per chunk.
"""

from typing import Optional

from torch import Tensor

from oryx_megatron.data.schedules import RouterSchedule
from oryx_megatron.mixer.router import ChunkDecisions


def chunk_decisions(model, schedule: RouterSchedule, batch_size: int, device) -> ChunkDecisions:
    """The ``ChunkDecisions`` of ``schedule`` for a megatron model's router (its ``model.router.chunk_size`` unless
    the schedule names one)."""
    return ChunkDecisions(getattr(model, "router", None), schedule, model.config.router.chunk_size, batch_size,
                          device)


def route_modes(model, schedule: RouterSchedule, tokens: Tensor, document_ids: Optional[Tensor] = None) -> Tensor:
    """The modes [b, s] (int8) a router schedule gives tokens [b, s] (one parallel routing pass)."""
    decisions = chunk_decisions(model, schedule, tokens.shape[0], tokens.device)
    chunk, s = decisions.chunk_size, tokens.shape[1]
    logits = model.route(tokens, chunk, document_ids)  # [b, ceil(s / chunk)]
    return decisions(logits).repeat_interleave(chunk, dim=1)[:, :s]
