"""Chunking helpers shared by the chunked recurrences (gated delta rule, SSD)."""

import torch
import torch.nn.functional as F


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """dtype of the decay math and the recurrent state: fp32, or fp64 for fp64 inputs (decided in Python: no
    dispatched type promotion per call of a decode step)."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def cast(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x in dtype; x itself when it already is (``Tensor.to`` would be a dispatched no-op, and a one-token step
    makes dozens of them per layer)."""
    return x if x.dtype == dtype else x.to(dtype)


def to_chunks(x: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """[b, s, h, d] -> [b, h, n, c, d] with n = ceil(s / c); the tail is zero-padded."""
    b, s, h, d = x.shape
    x = F.pad(x, (0, 0, 0, 0, 0, -s % chunk_size))
    return x.reshape(b, -1, chunk_size, h, d).permute(0, 3, 1, 2, 4)


def from_chunks(x: torch.Tensor, seq_len: int) -> torch.Tensor:
    """[b, h, n, c, d] -> [b, seq_len, h, d], dropping the padded tail."""
    b, h, n, c, d = x.shape
    return x.permute(0, 2, 3, 1, 4).reshape(b, n * c, h, d)[:, :seq_len]


def segsum(a: torch.Tensor) -> torch.Tensor:
    """Segment sums of log-decays: [..., T] -> [..., T, T] with out[i, j] = sum(a[j+1 : i+1]) for
    j <= i and -inf above the diagonal, so exp(out) is the causal decay matrix. Summed directly
    (not as a difference of cumsums), which stays accurate when the cumsums grow large."""
    t = a.shape[-1]
    causal = torch.ones(t, t, dtype=torch.bool, device=a.device).tril()
    terms = a[..., :, None].expand(*a.shape, t).masked_fill(~causal.tril(-1), 0)  # [i, j] = a[i] for j < i
    return terms.cumsum(-2).masked_fill(~causal, -torch.inf)


def document_starts(document_ids: torch.Tensor) -> torch.Tensor:
    """[b, s] document index of each token -> [b, s] bool, True where a new document starts (t > 0; the
    first token continues the initial state, if any)."""
    return F.pad(document_ids[:, 1:] != document_ids[:, :-1], (1, 0))


def reset_at_document_starts(log_decay: torch.Tensor, documents) -> torch.Tensor:
    """Log-decays with -inf at each document start of ``documents`` (``Documents``, ids [b, s]): the state
    entering the document decays to exactly zero (exp(-inf) = 0), so no term crosses a boundary, in the
    chunked forms as in the recurrence. ``documents`` None: unchanged.

    ``log_decay``: [b, s, h], a scalar decay per head (the gated delta rule's g, SSD's dt A), or [b, s, h, d_k],
    a decay per key dimension (GLA's gate: the state's row i decays by exp(log_decay[..., i])); any trailing
    dimensions after [b, s] take the token's reset."""
    if documents is None:
        return log_decay
    starts = document_starts(documents.ids)  # [b, s]
    return log_decay.masked_fill(starts.view(*starts.shape, *(1,) * (log_decay.dim() - 2)), -torch.inf)
