"""Mamba-2 (SSD), the linear mixer of Oryx-TM, with one B/C per head ("multi-head").

Per token t and head, the shared key is B, the shared value x and the linear query C:

    dt_t = softplus(W_dt x_t + dt_bias),   A = -exp(A_log)
    S_t = exp(A dt_t) S_{t-1} + dt_t k_t v_t^T,   o_t = S_t^T q_t + D v_t
"""

from typing import Dict, Optional, Tuple

import torch
from torch import Tensor

from oryx_megatron.config import MixerConfig
from oryx_megatron.mixer.heads import HeadShard
from oryx_megatron.mixer.linear.base import LinearMixer
from oryx_megatron.mixer.state import State
from oryx_megatron.ops import Documents, Kernels


class Mamba2Mixer(LinearMixer):
    """Streams q_lin [d_k], dt [1]; parameters A_log, dt_bias, D."""

    def __init__(self, config: MixerConfig, shard: HeadShard, kernels: Kernels):
        super().__init__(config, shard, kernels)
        self.add_decay_params()
        self.add_scalar_params({"D": ((config.num_attention_heads,), torch.ones)})  # skip

    @staticmethod
    def streams(config: MixerConfig) -> Dict[str, int]:
        return {"q_lin": config.kv_channels, "dt": 1}

    def forward(
        self, x: Dict[str, Tensor], initial_state: Optional[State] = None, output_final_state: bool = False,
        documents: Optional[Documents] = None,
    ) -> Tuple[Tensor, Optional[State]]:
        dt = self.time_step(x["dt"])  # [b, s, h] fp32
        o, S = self.kernels.ssd_chunk_scan(
            x=x["v"], dt=dt, A=self.A, B=x["k"], C=x["q_lin"], D=self.local("D"),
            initial_state=None if initial_state is None else initial_state["S"],
            output_final_state=output_final_state, chunk_size=self.config.linear_chunk_size,
            documents=documents,
        )  # o [b, s, h, d_v], final state [b, h, d_k, d_v]
        return o, None if S is None else {"S": S}

    def step(self, x: Dict[str, Tensor], state: State) -> Tuple[Tensor, State]:
        dt = self.time_step(x["dt"])  # [b, h] fp32
        o, S = self.kernels.ssd_step(x=x["v"], dt=dt, A=self.A, B=x["k"], C=x["q_lin"], state=state["S"],
                                     D=self.local("D"))
        return o, {"S": S}
