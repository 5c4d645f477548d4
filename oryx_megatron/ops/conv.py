"""Depthwise causal short convolution with a carried state, pure PyTorch.

With xpad = concat(state, x) along time, y[t, c] = act(bias[c] + sum_j weight[c, j] * xpad[t + j, c]):
weight[:, -1] multiplies the current token (nn.Conv1d with left padding, as causal-conv1d).
The state is the last w - 1 inputs (pre-activation), [b, c, w - 1].
"""

from typing import Optional, Tuple

import torch
import torch.nn.functional as F

from .chunking import cast
from .documents import Documents


def _activate(y: torch.Tensor, activation: Optional[str]) -> torch.Tensor:
    if activation is None:
        return y
    if activation == "silu":
        return F.silu(y)
    raise ValueError(f"activation must be 'silu' or None, got {activation!r}")


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    initial_state: Optional[torch.Tensor] = None,
    activation: Optional[str] = "silu",
    documents: Optional[Documents] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Causal depthwise conv over a sequence.

    Args:
        x: [b, s, c]; weight: [c, w]; bias: [c] or None;
        initial_state: [b, c, w - 1] (the previous inputs) or None (zeros); activation: "silu" or None.
        documents: packed documents (ids [b, s]) or None: a token sees only inputs of its own document
            (the initial state belongs to the first one).
    Returns:
        y [b, s, c] (contiguous: attention kernels need a unit stride in the head dim) and the final
        state [b, c, w - 1] (the last w - 1 inputs of concat(state, x); with documents, zeros for
        those outside the last token's document), both in x's dtype; the sum runs in the promoted
        dtype of x and weight.
    """
    b, s, c = x.shape
    w = weight.shape[1]
    dtype = torch.promote_types(x.dtype, weight.dtype)
    if initial_state is None:
        initial_state = x.new_zeros(b, c, w - 1)
    xpad = torch.cat([initial_state.to(x.dtype), x.transpose(1, 2)], dim=-1)  # [b, c, w - 1 + s]
    bias = None if bias is None else bias.to(dtype)
    document_ids = None if documents is None else documents.ids
    if document_ids is None:
        y = F.conv1d(xpad.to(dtype), weight.to(dtype)[:, None], bias, groups=c)  # [b, c, s]
    else:
        docs = _padded_documents(document_ids, w)  # [b, 1, w - 1 + s]
        y = sum(weight.to(dtype)[:, j, None] * (xpad[:, :, j : j + s] * (docs[..., j : j + s] == docs[..., w - 1:]))
                for j in range(w))  # [b, c, s]: tap j reads the input w - 1 - j positions back
        y = y if bias is None else y + bias[:, None]
    y = _activate(y, activation).transpose(1, 2).contiguous().to(x.dtype)
    return y, last_inputs(xpad, w, document_ids)


def last_inputs(xpad: torch.Tensor, w: int, document_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The conv state after a sequence: the last w - 1 inputs of xpad [b, c, w - 1 + s] (the state
    before it, then its inputs), with document_ids [b, s] zeros for those outside the last token's
    document: [b, c, w - 1], contiguous."""
    keep = xpad.shape[-1] - (w - 1)  # the first position kept (a slice from -(w - 1) breaks at w = 1)
    state = xpad[:, :, keep:]
    if document_ids is not None:
        docs = _padded_documents(document_ids, w)[..., keep:]  # [b, 1, w - 1]
        state = state * (docs == docs[..., -1:])
    return state.contiguous()


def _padded_documents(document_ids: torch.Tensor, w: int) -> torch.Tensor:
    """[b, s] -> [b, 1, w - 1 + s]: the state's w - 1 inputs belong to the first document."""
    return F.pad(document_ids[:, None], (w - 1, 0), mode="replicate")


def causal_conv1d_step(
    x: torch.Tensor,
    state: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    activation: Optional[str] = "silu",
) -> Tuple[torch.Tensor, torch.Tensor]:
    """One token of the causal conv.

    Args:
        x: [b, c]; state: [b, c, w - 1]; weight: [c, w]; bias: [c] or None.
    Returns:
        y [b, c] and the new state [b, c, w - 1], both in x's dtype.
    """
    window = torch.cat([cast(state, x.dtype), x[..., None]], dim=-1)  # [b, c, w]
    y = (window * weight).sum(-1)  # [b, c]
    if bias is not None:
        y = y + bias
    return cast(_activate(y, activation), x.dtype), window[..., 1:]
