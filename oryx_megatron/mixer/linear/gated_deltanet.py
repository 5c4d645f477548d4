"""Gated DeltaNet, the linear mixer of Oryx-TG (fla's GatedDeltaNet, one query/key per head).

Per token t and head, with q_t = q_lin_t and k_t L2-normalised and the state S [d_k, d_v]:

    a_t = -exp(A_log) softplus(W_a x_t + dt_bias)        log decay (<= 0)
    b_t = sigmoid(W_b x_t)                                write strength
    S_t = (I - b_t k_t k_t^T) exp(a_t) S_{t-1} + b_t k_t v_t^T,   o_t = S_t^T q_t / sqrt(d_k)
"""

from typing import Dict, Optional, Tuple

import torch
from torch import Tensor

from oryx_megatron.config import MixerConfig
from oryx_megatron.mixer.heads import HeadShard
from oryx_megatron.mixer.linear.base import LinearMixer
from oryx_megatron.mixer.state import State
from oryx_megatron.ops import Documents, Kernels, upcast


def l2_normalize(x: Tensor, eps: float = 1e-6) -> Tensor:
    """``F.normalize(x, dim=-1, eps=eps)`` bit for bit, without its Python layers (``torch.norm``'s): [.., d]."""
    return x / torch.linalg.vector_norm(x, dim=-1, keepdim=True).clamp_min(eps)


class GatedDeltaNetMixer(LinearMixer):
    """Streams q_lin [d_k], beta [1], alpha [1]; parameters A_log, dt_bias."""

    def __init__(self, config: MixerConfig, shard: HeadShard, kernels: Kernels):
        super().__init__(config, shard, kernels)
        self.add_decay_params()

    @staticmethod
    def streams(config: MixerConfig) -> Dict[str, int]:
        return {"q_lin": config.kv_channels, "beta": 1, "alpha": 1}

    def forward(
        self, x: Dict[str, Tensor], initial_state: Optional[State] = None, output_final_state: bool = False,
        documents: Optional[Documents] = None,
    ) -> Tuple[Tensor, Optional[State]]:
        q, k, a, beta = self._inputs(x)  # [b, s, h, d_k] twice, [b, s, h] fp32 twice
        o, S = self.kernels.chunk_gated_delta_rule(
            q, k, x["v"], a, beta, initial_state=None if initial_state is None else initial_state["S"],
            output_final_state=output_final_state, chunk_size=self.config.linear_chunk_size,
            documents=documents,
        )  # o [b, s, h, d_v], final state [b, h, d_k, d_v]
        return o, None if S is None else {"S": S}

    def step(self, x: Dict[str, Tensor], state: State) -> Tuple[Tensor, State]:
        q, k, a, beta = self._inputs(x)  # [b, h, d_k] twice, [b, h] fp32 twice
        o, S = self.kernels.gated_delta_rule_step(q, k, x["v"], a, beta, state["S"])
        return o, {"S": S}

    def _inputs(self, x: Dict[str, Tensor]) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
        """The kernel's inputs, for any leading shape [..]: L2-normalised query and key
        [.., h, d_k], log decay a and write strength beta [.., h] (fp32)."""
        q, k = (l2_normalize(x[name]) for name in ("q_lin", "k"))
        a = self.A * self.time_step(x["alpha"])  # -exp(A_log) softplus(W_a x + dt_bias)
        beta = torch.sigmoid(upcast(x["beta"][..., 0]))  # sigmoid(W_b x)
        return q, k, a, beta
