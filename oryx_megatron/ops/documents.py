"""Packed documents: which document each token of a batch belongs to, and what kernels derive from it."""

import dataclasses
import functools

import torch
import torch.nn.functional as F
from torch import Tensor


@dataclasses.dataclass(frozen=True)
class Varlen:
    """The packed documents of a batch as variable-length kernels (fla's ``cu_seqlens``) take them."""

    cu_seqlens: Tensor  # [count + 1] long: starts of the documents in the flattened batch, then b * s
    cu_seqlens_cpu: Tensor  # the same on the host (fla sizes its grid from it: no sync of its own)
    first: Tensor  # [b] long: the index of each sample's first document
    last: Tensor  # [b] long: ... and of its last
    count: int


class Documents:
    """``ids`` [b, s] int: the document of each token (a document starts where the id changes, and at every
    sample's start). The model makes one per forward and hands it to every layer, as megatron hands down
    ``PackedSeqParams``; what a kernel derives from the ids is computed on first use and kept for the
    other layers (``varlen``: one host sync per forward)."""

    def __init__(self, ids: Tensor):
        self.ids = ids

    @functools.cached_property
    def seq_idx(self) -> Tensor:
        """The ids as int32 (mamba-ssm's and causal-conv1d's ``seq_idx``)."""
        return self.ids.to(torch.int32)

    @functools.cached_property
    def varlen(self) -> Varlen:
        b, s = self.ids.shape
        starts = F.pad(self.ids[:, 1:] != self.ids[:, :-1], (1, 0), value=True).flatten()  # [b * s]
        positions = starts.nonzero().flatten()
        cu_seqlens = F.pad(positions, (0, 1), value=b * s)
        per_sample = starts.view(b, s).sum(-1)
        last = per_sample.cumsum(0) - 1
        return Varlen(cu_seqlens, cu_seqlens.cpu(), last - per_sample + 1, last, len(positions))


def ids_of(documents: "Documents | None") -> "Tensor | None":
    """The ids [b, s] of ``documents``, or None."""
    return None if documents is None else documents.ids
