"""Mamba-2 SSD (state-space duality), pure PyTorch, one B/C per head ("multi-head").

Recurrence per token t and head, in the state layout S [d_state, head_dim] shared with the
gated delta rule (B plays the key, x the value, C the query):

    S_t = exp(dt_t * A) * S_{t-1} + dt_t * B_t x_t^T
    y_t = S_t^T C_t + D * x_t
"""

from typing import Optional, Tuple

import torch
import torch.nn.functional as F

from .chunking import (
    cast,
    compute_dtype,
    from_chunks,
    reset_at_document_starts,
    segsum,
    to_chunks,
)
from .documents import Documents


def ssd_chunk_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: Optional[torch.Tensor] = None,
    initial_state: Optional[torch.Tensor] = None,
    output_final_state: bool = True,
    chunk_size: int = 64,
    documents: Optional[Documents] = None,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Chunked SSD scan (same numbers as looping `ssd_step`), as mamba's `ssd_minimal_discrete`
    plus an initial state, per-head B/C and any length (the tail is padded with dt = 0).

    Args:
        x: [b, s, h, p] values; dt: [b, s, h] step sizes (already softplus-ed, > 0);
        A: [h] (< 0); B: [b, s, h, n] keys; C: [b, s, h, n] queries; D: [h] skip or None.
        initial_state: [b, h, n, p] or None (zeros).
        documents: packed documents (``Documents``, ids [b, s]) or None: the state restarts from zero where
            the id changes (the first document continues initial_state); the final state is the last one's.
    Returns:
        y [b, s, h, p] in x's dtype; final state [b, h, n, p] in fp32 (fp64 for fp64 inputs),
        or None when not output_final_state.
    """
    b, s, h, p = x.shape
    out_dtype, dtype = x.dtype, compute_dtype(x)
    x, dt = x.to(dtype), dt.to(dtype)

    X = to_chunks(x * dt[..., None], chunk_size)  # [b, h, nc, c, p]  the token's write dt_t x_t
    Bc, Cc = (to_chunks(t.to(dtype), chunk_size) for t in (B, C))  # [b, h, nc, c, n]
    a = reset_at_document_starts(dt * A.to(dtype), documents)  # [b, s, h] log-decays
    a = to_chunks(a[..., None], chunk_size)[..., 0]  # [b, h, nc, c]
    decay = segsum(a).exp()  # [b, h, nc, c, c]

    # 1. within each chunk: causal decayed "attention" C_t.B_j over the chunk's writes
    y_diag = ((Cc @ Bc.transpose(-1, -2)) * decay) @ X  # [b, h, nc, c, p]

    # 2. each chunk's writes, decayed to the chunk end
    states = (Bc * decay[..., -1, :, None]).transpose(-1, -2) @ X  # [b, h, nc, n, p]

    # 3. across chunks: state entering each chunk, and after the last one
    S0 = x.new_zeros(b, h, Bc.shape[-1], p) if initial_state is None else initial_state.to(dtype)
    states = torch.cat([S0[:, :, None], states], dim=2)  # [b, h, nc + 1, n, p]
    chunk_decay = segsum(F.pad(a.sum(-1), (1, 0))).exp()  # [b, h, nc + 1, nc + 1]
    states = torch.einsum("bhzc,bhcnp->bhznp", chunk_decay, states)  # state after z chunks
    entering, final_state = states[:, :, :-1], states[:, :, -1]

    # 4. each token reads the decayed entering state
    y_off = (Cc * a.cumsum(-1)[..., None].exp()) @ entering  # [b, h, nc, c, p]

    y = from_chunks(y_diag + y_off, s)  # [b, s, h, p]
    if D is not None:
        y = y + D.to(dtype)[:, None] * x
    return y.to(out_dtype), final_state if output_final_state else None


def ssd_step(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    state: torch.Tensor,
    D: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """One token of SSD (the naive recurrence, the reference for the chunked scan).

    Args:
        x: [b, h, p]; dt: [b, h]; A: [h]; B, C: [b, h, n]; state: [b, h, n, p]; D: [h] or None.
    Returns:
        y [b, h, p] in x's dtype; new state [b, h, n, p] in fp32 (fp64 for fp64 inputs).
    """
    out_dtype, dtype = x.dtype, compute_dtype(x)
    x, dt, B, C = (cast(t, dtype) for t in (x, dt, B, C))

    decay = (dt * cast(A, dtype)).exp()[..., None, None]  # [b, h, 1, 1]
    S = torch.addcmul(cast(state, dtype) * decay, (dt[..., None] * B)[..., :, None], x[..., None, :])  # [b, h, n, p]
    y = (C[..., :, None] * S).sum(-2)  # [b, h, p]: C S (a product and a sum: fewer ops than a batched matmul)
    if D is not None:
        y = torch.addcmul(y, cast(D, dtype)[:, None], x)
    return cast(y, out_dtype), S
