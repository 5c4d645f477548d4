"""Gated Linear Attention (Yang et al. 2024, fla's GLA with one query/key per head) as a mixer from outside the
package: its kernel ops and the mixer, registered on import (by tests/mixers/__init__.py).

Per token t, head and key dimension i, with the state S [d_k, d_v]:

    log alpha_t = logsigmoid(W_up (W_low x_t) + b) / 16   a decay per key dimension, from fla's low-rank gate
    S_t = diag(alpha_t) S_{t-1} + k_t v_t^T,   o_t = S_t^T q_t / sqrt(d_k)

W_low (hidden -> 16) is a projection that every head reads (``hidden_projections``: the front ends build it,
replicated over tensor-parallel ranks); W_up and b are per head, this mixer's own parameters.
"""

from typing import Dict, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from oryx_megatron.config import MixerConfig
from oryx_megatron.mixer import LINEAR_MIXERS, LinearMixer
from oryx_megatron.mixer.state import State
from oryx_megatron.ops import Documents, KernelOp, register_op, upcast
from oryx_megatron.ops.chunking import compute_dtype, from_chunks, reset_at_document_starts, segsum, to_chunks

GATE_NORMALISER = 16  # fla's gate_logit_normalizer: decays near 1 at initialisation
GATE_LOW_RANK = 16  # fla's gate_low_rank_dim


def chunk_gla(q: Tensor, k: Tensor, v: Tensor, g: Tensor, scale: Optional[float] = None,
              initial_state: Optional[Tensor] = None, output_final_state: bool = True, chunk_size: int = 64,
              documents: Optional[Documents] = None) -> Tuple[Tensor, Optional[Tensor]]:
    """Chunked GLA (same numbers as looping ``gla_step``): q, k [b, s, h, d_k]; v [b, s, h, d_v]; g [b, s, h, d_k]
    log decays (<= 0); initial_state [b, h, d_k, d_v] or None (zeros); documents: the state restarts at each
    document start. Returns o [b, s, h, d_v] in v's dtype and the final state [b, h, d_k, d_v] (fp32, fp64 for
    fp64 inputs) or None.

    Within a chunk with cumulative log decays G_t = g_1 + .. + g_t (per dimension) and state S0 at its start:
    o_t = (q_t exp(G_t))^T S0 + sum_{j<=t} sum_i q_ti k_ji exp(G_ti - G_ji) v_j, S_c = exp(G_c) S0 + sum_j (k_j
    exp(G_c - G_j)) v_j^T; exp(G_t - G_j) as segment sums (no difference of cumsums: exact at a reset's -inf)."""
    b, s, h, d_k = k.shape
    out_dtype, dtype = v.dtype, compute_dtype(v)
    scale = d_k**-0.5 if scale is None else scale
    q, k, v = (to_chunks(t.to(dtype), chunk_size) for t in (q, k, v))  # [b, h, n, c, d]
    g = to_chunks(reset_at_document_starts(g.to(dtype), documents), chunk_size)  # [b, h, n, c, d_k], padding 0
    q = q * scale
    decay = segsum(g.transpose(-1, -2)).exp()  # [b, h, n, d_k, c, c]: exp(G_t - G_j) for j <= t, else 0
    attn = torch.einsum("bhntd,bhnjd,bhndtj->bhntj", q, k, decay)  # [b, h, n, c, c]
    q_in = q * g.cumsum(-2).exp()  # [b, h, n, c, d_k]: reads of the chunk's initial state
    k_out = k * decay[..., -1, :].transpose(-1, -2)  # [b, h, n, c, d_k]: writes decayed to the chunk end
    chunk_decay = g.sum(-2).exp()[..., None]  # [b, h, n, d_k, 1]
    S = k.new_zeros(b, h, d_k, v.shape[-1]) if initial_state is None else initial_state.to(dtype)
    o = []
    for i in range(q.shape[2]):
        o.append(q_in[:, :, i] @ S + attn[:, :, i] @ v[:, :, i])
        S = chunk_decay[:, :, i] * S + k_out[:, :, i].transpose(-1, -2) @ v[:, :, i]  # [b, h, d_k, d_v]
    o = from_chunks(torch.stack(o, dim=2), s)  # [b, s, h, d_v]
    return o.to(out_dtype), S if output_final_state else None


def gla_step(q: Tensor, k: Tensor, v: Tensor, g: Tensor, state: Tensor,
             scale: Optional[float] = None) -> Tuple[Tensor, Tensor]:
    """One token of GLA (the recurrence): q, k, g [b, h, d_k]; v [b, h, d_v]; state [b, h, d_k, d_v] -> o [b, h, d_v]
    in v's dtype, the new state (fp32, fp64 for fp64 inputs)."""
    out_dtype, dtype = v.dtype, compute_dtype(v)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    q, k, v, g = (t.to(dtype) for t in (q, k, v, g))
    S = state.to(dtype) * g.exp()[..., None] + k[..., :, None] * v[..., None, :]
    return torch.einsum("bhk,bhkv->bhv", q * scale, S).to(out_dtype), S


register_op(KernelOp("chunk_gla", chunk_gla, outputs=("o", "final_state"), backward=True))  # torch only
register_op(KernelOp("gla_step", gla_step, outputs=("o", "new_state")))


class GatedLinearAttention(LinearMixer):
    """Stream q_lin [d_k]; the gate's low-rank features decay_low [16] of the hidden state, shared by the heads;
    parameters decay_up [h, d_k, 16], decay_bias [h, d_k]."""

    def __init__(self, config: MixerConfig, shard, kernels):
        super().__init__(config, shard, kernels)
        h, d_k = config.num_attention_heads, config.kv_channels
        self.add_head_params({"decay_up": ((h, d_k, GATE_LOW_RANK), lambda shape: torch.randn(shape) / 4),
                              "decay_bias": ((h, d_k), torch.zeros)})

    @staticmethod
    def streams(config: MixerConfig) -> Dict[str, int]:
        return {"q_lin": config.kv_channels}

    @staticmethod
    def hidden_projections(config: MixerConfig) -> Dict[str, int]:
        return {"decay_low": GATE_LOW_RANK}

    def forward(self, x: Dict[str, Tensor], initial_state: Optional[State] = None, output_final_state: bool = False,
                documents: Optional[Documents] = None) -> Tuple[Tensor, Optional[State]]:
        o, S = self.kernels.chunk_gla(x["q_lin"], x["k"], x["v"], self._log_decay(x),
                                      initial_state=None if initial_state is None else initial_state["S"],
                                      output_final_state=output_final_state,
                                      chunk_size=self.config.linear_chunk_size, documents=documents)
        return o, None if S is None else {"S": S}

    def step(self, x: Dict[str, Tensor], state: State) -> Tuple[Tensor, State]:
        o, S = self.kernels.gla_step(x["q_lin"], x["k"], x["v"], self._log_decay(x), state["S"])
        return o, {"S": S}

    def _log_decay(self, x: Dict[str, Tensor]) -> Tensor:
        """log alpha [.., h, d_k] in fp32 (or wider), from decay_low [.., 16]."""
        gate = torch.einsum("...r,hdr->...hd", x["decay_low"], self.local("decay_up")) + self.local("decay_bias")
        return F.logsigmoid(upcast(gate)) / GATE_NORMALISER


LINEAR_MIXERS["gla"] = GatedLinearAttention
