"""Linear attention with a normalizer (Katharopoulos et al. 2020, with a decay per head) as a mixer plugin: its
ops, the mixer, and the plugin that registers them (the entry point ``oryx_megatron.mixers``: ``lanorm``).

Per token t and head, with feature maps phi(x) = elu(x) + 1 > 0 of the linear query q_t and the shared key k_t,
and two state tensors: the memory S [d_k, d_v] and the normalizer z [d_k] (the sum of the keys it holds):

    log gamma_t = -exp(A_log) softplus(W_dt x_t + dt_bias)       a decay per head (<= 0)
    S_t = gamma_t S_{t-1} + phi(k_t) v_t^T,   z_t = gamma_t z_{t-1} + phi(k_t)
    o_t = S_t^T phi(q_t) / (z_t . phi(q_t))
"""

from typing import Dict, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from oryx_megatron.config import MixerConfig, MixerPlugin
from oryx_megatron.mixer import LinearMixer
from oryx_megatron.mixer.state import State
from oryx_megatron.ops import Documents, KernelOp, register_op
from oryx_megatron.ops.chunking import compute_dtype, from_chunks, reset_at_document_starts, segsum, to_chunks


def chunk_lanorm(q: Tensor, k: Tensor, v: Tensor, g: Tensor, initial_state: Optional[Tensor] = None,
                 initial_normalizer: Optional[Tensor] = None, output_final_state: bool = True, chunk_size: int = 64,
                 documents: Optional[Documents] = None) -> Tuple[Tensor, Optional[Tensor], Optional[Tensor]]:
    """Chunked form (same numbers as looping ``lanorm_step``): q, k [b, s, h, d_k] features (> 0); v [b, s, h, d_v];
    g [b, s, h] log decays (<= 0); the initial S [b, h, d_k, d_v] and z [b, h, d_k], or None (zeros); documents:
    both restart at each document start. Returns o [b, s, h, d_v] in v's dtype, the final S and z (fp32, fp64 for
    fp64 inputs) or None twice. The normalizer is the memory of a value that is 1 everywhere: one more value
    column through the same scan, split off at the end."""
    b, s, h, d_k = k.shape
    out_dtype, dtype = v.dtype, compute_dtype(v)
    ones = torch.ones_like(v[..., :1])
    q, k, v = (to_chunks(t.to(dtype), chunk_size) for t in (q, k, torch.cat([v, ones], dim=-1)))  # [b, h, n, c, d]
    g = to_chunks(reset_at_document_starts(g.to(dtype), documents)[..., None], chunk_size)[..., 0]  # [b, h, n, c]
    decay = segsum(g).exp()  # [b, h, n, c, c]: prod of gamma over (j, t] for j <= t, else 0
    attn = (q @ k.transpose(-1, -2)) * decay  # [b, h, n, c, c]
    q_in = q * g.cumsum(-1).exp()[..., None]  # reads of the chunk's initial state
    k_out = k * decay[..., -1, :, None]  # writes decayed to the chunk's end
    chunk_decay = g.sum(-1).exp()[..., None, None]  # [b, h, n, 1, 1]
    S = k.new_zeros(b, h, d_k, v.shape[-1])  # [b, h, d_k, d_v + 1]: [S, z]
    if initial_state is not None:
        S = torch.cat([initial_state.to(dtype), initial_normalizer.to(dtype)[..., None]], dim=-1)
    o = []
    for i in range(q.shape[2]):
        o.append(q_in[:, :, i] @ S + attn[:, :, i] @ v[:, :, i])
        S = chunk_decay[:, :, i] * S + k_out[:, :, i].transpose(-1, -2) @ v[:, :, i]
    o = from_chunks(torch.stack(o, dim=2), s)  # [b, s, h, d_v + 1]: numerator, denominator
    o = (o[..., :-1] / o[..., -1:]).to(out_dtype)
    return (o, S[..., :-1], S[..., -1]) if output_final_state else (o, None, None)


def lanorm_step(q: Tensor, k: Tensor, v: Tensor, g: Tensor, state: Tensor,
                normalizer: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
    """One token (the recurrence): q, k [b, h, d_k] features; v [b, h, d_v]; g [b, h]; S [b, h, d_k, d_v], z [b, h,
    d_k] -> o [b, h, d_v] in v's dtype, the new S and z (fp32, fp64 for fp64 inputs)."""
    out_dtype, dtype = v.dtype, compute_dtype(v)
    q, k, v, gamma = q.to(dtype), k.to(dtype), v.to(dtype), g.to(dtype).exp()
    S = gamma[..., None, None] * state.to(dtype) + k[..., :, None] * v[..., None, :]
    z = gamma[..., None] * normalizer.to(dtype) + k
    o = torch.einsum("bhk,bhkv->bhv", q, S) / (z * q).sum(-1, keepdim=True)
    return o.to(out_dtype), S, z


register_op(KernelOp("chunk_lanorm", chunk_lanorm, outputs=("o", "final_state", "final_normalizer"), backward=True))
register_op(KernelOp("lanorm_step", lanorm_step, outputs=("o", "new_state", "new_normalizer")))


class NormalizedLinearAttention(LinearMixer):
    """Streams q_lin [d_k], dt [1]; parameters A_log, dt_bias; state S [b, h, d_k, d_v] and z [b, h, d_k]."""

    def __init__(self, config: MixerConfig, shard, kernels):
        super().__init__(config, shard, kernels)
        self.add_decay_params()

    @staticmethod
    def streams(config: MixerConfig) -> Dict[str, int]:
        return {"q_lin": config.kv_channels, "dt": 1}

    def state_spec(self, batch_size: int, dtype: torch.dtype) -> Dict[str, Tuple[Tuple[int, ...], torch.dtype]]:
        b, h, dtype = batch_size, self.num_heads, torch.promote_types(dtype, torch.float32)
        return {"S": ((b, h, self.d_k, self.d_v), dtype), "z": ((b, h, self.d_k), dtype)}

    def forward(self, x: Dict[str, Tensor], initial_state: Optional[State] = None, output_final_state: bool = False,
                documents: Optional[Documents] = None) -> Tuple[Tensor, Optional[State]]:
        initial = (None, None) if initial_state is None else (initial_state["S"], initial_state["z"])
        o, S, z = self.kernels.chunk_lanorm(*self._inputs(x), *initial, output_final_state=output_final_state,
                                            chunk_size=self.config.linear_chunk_size, documents=documents)
        return o, None if S is None else {"S": S, "z": z}

    def step(self, x: Dict[str, Tensor], state: State) -> Tuple[Tensor, State]:
        o, S, z = self.kernels.lanorm_step(*self._inputs(x), state["S"], state["z"])
        return o, {"S": S, "z": z}

    def _inputs(self, x: Dict[str, Tensor]) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
        """phi(q), phi(k) [.., h, d_k], v [.., h, d_v], log gamma [.., h] (fp32 or wider)."""
        q, k = (F.elu(x[name]) + 1 for name in ("q_lin", "k"))
        return q, k, x["v"], self.A * self.time_step(x["dt"])


PLUGIN = MixerPlugin(mixers={"lanorm": NormalizedLinearAttention}, letters={"N": "lanorm"})
