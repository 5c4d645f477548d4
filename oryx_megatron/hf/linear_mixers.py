"""The linear mixers of the Hugging Face Oryx model: Gated DeltaNet (Oryx-TG, ``gdn``) and Mamba-2 with one
B/C per head (Oryx-TM, ``mamba2``), over the mixer's shared keys and values.

Each holds its per-head fp32 parameters (A_log, dt_bias, and Mamba-2's skip D: fp32 under any dtype) and
runs the kernels of ``oryx_megatron.ops`` on a sequence (``forward``) or one token (``step``):

    gdn     a_t = -exp(A_log) softplus(W_a x_t + dt_bias),  b_t = sigmoid(W_b x_t),  q_t, k_t L2-normalised
            S_t = (I - b_t k_t k_t^T) exp(a_t) S_{t-1} + b_t k_t v_t^T,   o_t = S_t^T q_t / sqrt(d_k)
    mamba2  dt_t = softplus(W_dt x_t + dt_bias),  A = -exp(A_log)
            S_t = exp(A dt_t) S_{t-1} + dt_t k_t v_t^T,                    o_t = S_t^T q_t + D v_t
"""

import math
from typing import Dict, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import initialization as init

from oryx_megatron.hf.layout import LINEAR_PARAMETERS
from oryx_megatron.ops import Kernels, upcast


class LinearMixer(nn.Module):
    """Streams x: name -> [b, s, h, width] (``forward``) or [b, h, width] (``step``), with the shared ``k``
    [.., h, d_k] and ``v`` [.., h, d_v] after their convs; the state is [b, h, d_k, d_v] fp32."""

    name: str

    def __init__(self, config, kernels: Kernels):
        super().__init__()
        self.kernels, self.chunk_size = kernels, config.linear_chunk_size
        for param in LINEAR_PARAMETERS[self.name]:
            self.register_parameter(param, nn.Parameter(torch.empty(config.num_attention_heads, dtype=torch.float32)))

    @property
    def A(self) -> Tensor:
        """-exp(A_log) [h], fp32."""
        return -torch.exp(upcast(self.A_log))

    def time_step(self, raw: Tensor) -> Tensor:
        """softplus(raw + dt_bias): a width-1 stream [.., h, 1] -> [.., h], fp32."""
        return F.softplus(upcast(raw[..., 0]) + upcast(self.dt_bias))

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Mamba-2's initialisation (megatron's defaults): A in [1, 16], dt in [1e-3, 1e-1] log-uniform, D = 1;
        transformers' guarded init: loaded parameters are left alone."""
        init.copy_(self.A_log, torch.empty_like(self.A_log).uniform_(1.0, 16.0).log())
        log_dt = torch.rand_like(self.dt_bias) * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3)
        dt = log_dt.exp().clamp(min=1e-4)
        init.copy_(self.dt_bias, dt + torch.log(-torch.expm1(-dt)))  # inverse softplus
        if hasattr(self, "D"):
            init.ones_(self.D)


class GatedDeltaNet(LinearMixer):
    """Streams q_lin [d_k], beta [1], alpha [1]; parameters A_log, dt_bias."""

    name = "gdn"

    def forward(self, x: Dict[str, Tensor], initial_state: Optional[Tensor], output_final_state: bool,
                document_ids: Optional[Tensor] = None) -> Tuple[Tensor, Optional[Tensor]]:
        q, k, a, beta = self._inputs(x)  # [b, s, h, d_k] twice, [b, s, h] fp32 twice
        return self.kernels.chunk_gated_delta_rule(q, k, x["v"], a, beta, initial_state=initial_state,
                                                   output_final_state=output_final_state, chunk_size=self.chunk_size,
                                                   document_ids=document_ids)  # o [b, s, h, d_v], state

    def step(self, x: Dict[str, Tensor], state: Tensor) -> Tuple[Tensor, Tensor]:
        q, k, a, beta = self._inputs(x)  # [b, h, d_k] twice, [b, h] fp32 twice
        return self.kernels.gated_delta_rule_step(q, k, x["v"], a, beta, state)

    def _inputs(self, x: Dict[str, Tensor]) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
        q, k = (F.normalize(x[name], p=2, dim=-1, eps=1e-6) for name in ("q_lin", "k"))
        return q, k, self.A * self.time_step(x["alpha"]), torch.sigmoid(upcast(x["beta"][..., 0]))


class Mamba2(LinearMixer):
    """Streams q_lin [d_k] (C), dt [1]; the shared k is B and v is x; parameters A_log, dt_bias, D."""

    name = "mamba2"

    def forward(self, x: Dict[str, Tensor], initial_state: Optional[Tensor], output_final_state: bool,
                document_ids: Optional[Tensor] = None) -> Tuple[Tensor, Optional[Tensor]]:
        return self.kernels.ssd_chunk_scan(x=x["v"], dt=self.time_step(x["dt"]), A=self.A, B=x["k"], C=x["q_lin"],
                                           D=self.D, initial_state=initial_state, output_final_state=output_final_state,
                                           chunk_size=self.chunk_size, document_ids=document_ids)

    def step(self, x: Dict[str, Tensor], state: Tensor) -> Tuple[Tensor, Tensor]:
        return self.kernels.ssd_step(x=x["v"], dt=self.time_step(x["dt"]), A=self.A, B=x["k"], C=x["q_lin"],
                                     state=state, D=self.D)


LINEAR_MIXERS = {cls.name: cls for cls in (GatedDeltaNet, Mamba2)}
