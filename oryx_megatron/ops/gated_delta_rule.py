"""Gated delta rule (Gated DeltaNet), pure PyTorch: chunked WY/UT form and single-token step.

Recurrence per token t and head (state S [d_k, d_v], as fla's `naive_recurrent_gated_delta_rule`):

    S   = exp(g_t) * S
    u_t = beta_t * (v_t - S^T k_t)
    S   = S + k_t u_t^T
    o_t = S^T (scale * q_t)
"""

from typing import Optional, Tuple

import torch

from .chunking import (
    cast,
    compute_dtype,
    from_chunks,
    reset_at_document_starts,
    segsum,
    to_chunks,
)
from .documents import Documents


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: Optional[float] = None,
    initial_state: Optional[torch.Tensor] = None,
    output_final_state: bool = True,
    chunk_size: int = 64,
    documents: Optional[Documents] = None,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Chunked gated delta rule (same numbers as looping `gated_delta_rule_step`).

    Args:
        q, k: [b, s, h, d_k] (already L2-normalised by the caller); v: [b, s, h, d_v].
        g: [b, s, h] log-decay (<= 0); beta: [b, s, h] write strength in (0, 1).
        scale: query scale, default d_k ** -0.5.
        initial_state: [b, h, d_k, d_v] or None (zeros).
        documents: packed documents (``Documents``, ids [b, s]) or None: the state restarts from zero where
            the id changes (the first document continues initial_state); the final state is the last one's.
    Returns:
        o [b, s, h, d_v] in v's dtype; final state [b, h, d_k, d_v] in fp32 (fp64 for fp64
        inputs), or None when not output_final_state.

    Within a chunk with cumulative log-decay G_t = g_1 + ... + g_t and state S0 at its start,
    the writes U = [u_1..u_c] solve the unit lower-triangular system (UT transform)
        (I + A) U = beta * V - (beta * exp(G) * K) S0,   A[t, j] = beta_t exp(G_t - G_j) k_t.k_j (j < t),
    after which o_t = exp(G_t) S0^T q_t + sum_{j<=t} exp(G_t - G_j) (q_t.k_j) u_j and
    S_c = exp(G_c) S0 + sum_j exp(G_c - G_j) k_j u_j^T. Padding uses g = 0, beta = 0 (no change).
    """
    b, s, h, d_k = k.shape
    d_v = v.shape[-1]
    out_dtype, dtype = v.dtype, compute_dtype(v)
    scale = d_k**-0.5 if scale is None else scale

    q, k, v = (to_chunks(x.to(dtype), chunk_size) for x in (q, k, v))  # [b, h, n, c, d]
    q = q * scale
    g = reset_at_document_starts(g.to(dtype), documents)
    g, beta = (to_chunks(x.to(dtype)[..., None], chunk_size) for x in (g, beta))  # [b, h, n, c, 1]

    decay = segsum(g[..., 0]).exp()  # [b, h, n, c, c]  exp(G_t - G_j) for j <= t, else 0
    G = g.cumsum(-2)  # [b, h, n, c, 1]

    # UT transform, chunk-local: solve (I + A) [W | U] = [beta exp(G) K | beta V]
    eye = torch.eye(chunk_size, dtype=dtype, device=k.device)
    A = (beta * (k @ k.transpose(-1, -2)) * decay).tril(-1)  # [b, h, n, c, c]
    rhs = torch.cat([beta * G.exp() * k, beta * v], dim=-1)  # [b, h, n, c, d_k + d_v]
    W, U = torch.linalg.solve_triangular(eye + A, rhs, upper=False, unitriangular=True).split([d_k, d_v], -1)

    attn = (q @ k.transpose(-1, -2)) * decay  # [b, h, n, c, c]
    q_in = q * G.exp()  # [b, h, n, c, d_k]  reads of the chunk's initial state
    k_out = k * decay[..., -1, :, None]  # [b, h, n, c, d_k]  writes decayed to the chunk end
    chunk_decay = G[..., -1, :, None].exp()  # [b, h, n, 1, 1]

    S = k.new_zeros(b, h, d_k, d_v) if initial_state is None else initial_state.to(dtype)
    o = []
    for i in range(q.shape[2]):
        u = U[:, :, i] - W[:, :, i] @ S  # [b, h, c, d_v]
        o.append(q_in[:, :, i] @ S + attn[:, :, i] @ u)
        S = chunk_decay[:, :, i] * S + k_out[:, :, i].transpose(-1, -2) @ u  # [b, h, d_k, d_v]
    o = from_chunks(torch.stack(o, dim=2), s)  # [b, s, h, d_v]
    return o.to(out_dtype), S if output_final_state else None


def gated_delta_rule_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    scale: Optional[float] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """One token of the gated delta rule (the naive recurrence, the reference for the chunked form).

    Args:
        q, k: [b, h, d_k]; v: [b, h, d_v]; g, beta: [b, h]; state: [b, h, d_k, d_v].
    Returns:
        o [b, h, d_v] in v's dtype; new state [b, h, d_k, d_v] in fp32 (fp64 for fp64 inputs).
    """
    out_dtype, dtype = v.dtype, compute_dtype(v)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    q, k, v, g, beta = (cast(x, dtype) for x in (q, k, v, g, beta))

    S = cast(state, dtype) * g.exp()[..., None, None]  # [b, h, d_k, d_v]
    k = k[..., :, None]  # [b, h, d_k, 1]
    u = beta[..., None] * (v - (k * S).sum(-2))  # [b, h, d_v]: v - k S (products and sums: fewer ops than matmuls)
    S = torch.addcmul(S, k, u[..., None, :])
    o = ((q * scale)[..., :, None] * S).sum(-2)  # [b, h, d_v]: q S
    return cast(o, out_dtype), S
