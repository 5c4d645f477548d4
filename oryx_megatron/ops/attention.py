"""Causal softmax attention via torch's scaled_dot_product_attention (flash / efficient / math
backend chosen by torch), with the queries aligned to the end of the key sequence; and its
block-sparse form, which computes only the query blocks where some token reads attention."""

from typing import Callable, Dict, Hashable, List, Optional

import torch
import torch.nn.functional as F


def causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: Optional[float] = None,
    document_ids: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Causal attention where the queries are the last sq positions of the key sequence.

    Args:
        q: [b, sq, h, d_k]; k: [b, sk, h, d_k]; v: [b, sk, h, d_v] with sk >= sq.
        scale: default d_k ** -0.5.
        document_ids: [b, sk] int (the keys'; the queries' are the last sq) or None: a query sees
            only the keys of its own document (packed documents).
    Returns:
        o [b, sq, h, d_v]; query i sees keys j <= sk - sq + i (bottom-right aligned mask).
    """
    sq, sk = q.shape[1], k.shape[1]
    if sq > sk:
        raise ValueError(f"causal_attention needs sk >= sq, got sq={sq}, sk={sk}")
    mask = None  # sq == sk: is_causal; sq == 1: the last query sees every key
    if 1 < sq < sk or document_ids is not None:
        mask = torch.ones(sq, sk, dtype=torch.bool, device=q.device).tril(sk - sq)  # [sq, sk]
    if document_ids is not None:
        mask = (mask & (document_ids[:, -sq:, None] == document_ids[:, None, :]))[:, None]  # [b, 1, sq, sk]
    o = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),  # [b, h, s, d]
        attn_mask=mask, is_causal=mask is None and sq == sk, scale=scale,
    )  # [b, h, sq, d_v]
    return o.transpose(1, 2)


class BlockReads:
    """The positions that read attention, ``read`` [b, sq] bool, by query blocks of ``block_size`` positions: the
    block-sparse read of one forward. The model makes one per forward and every layer shares it, with what an
    attention kernel derives from it (``derived``: the torch op's block lists, FlexAttention's block mask)."""

    def __init__(self, read: torch.Tensor, block_size: int = 128):
        self.read, self.block_size = read, block_size
        self._derived: Dict[Hashable, object] = {}

    def derived(self, key: Hashable, build: Callable[[], object]) -> object:
        """``build()``, computed on the first call with ``key`` and kept."""
        if key not in self._derived:
            self._derived[key] = build()
        return self._derived[key]

    def block_lists(self) -> List[List[int]]:
        """Per query block, the sequences that read in it (one host sync per forward)."""
        return self.derived("block_lists", self._block_lists)

    def _block_lists(self) -> List[List[int]]:
        b, sq = self.read.shape
        n = -(-sq // self.block_size)
        blocks = F.pad(self.read, (0, n * self.block_size - sq)).view(b, n, self.block_size).any(-1)  # [b, n]
        return [[i for i, reads in enumerate(rows) if reads] for rows in blocks.t().tolist()]


def block_sparse_causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, reads: BlockReads, scale: Optional[float] = None,
    document_ids: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Causal attention computed only for the query blocks that hold a reading position.

    Args:
        q: [b, sq, h, d_k]; k: [b, sk, h, d_k]; v: [b, sk, h, d_v], queries at the last sq positions.
        reads: the positions whose output is wanted (``BlockReads``: read [b, sq] bool, by blocks of
            ``block_size`` query positions); a block of a sequence is computed when any of its positions
            reads, against every key up to the block's end.
        document_ids: [b, sk] int or None, as ``causal_attention``'s.
    Returns:
        o [b, sq, h, d_v]: equal to ``causal_attention`` at every reading position, zero in blocks
        where no position reads (other positions of a computed block hold their attention output).
    """
    b, sq = reads.read.shape
    offset, block = k.shape[1] - q.shape[1], reads.block_size
    lists = reads.block_lists()
    if all(len(seqs) == b for seqs in lists):
        return causal_attention(q, k, v, scale, document_ids)
    o = q.new_zeros(*q.shape[:3], v.shape[-1])
    for i, seqs in enumerate(lists):  # query block i of every sequence that reads in it
        lo, hi = i * block, min((i + 1) * block, sq)
        if seqs:
            idx = slice(None) if len(seqs) == b else torch.tensor(seqs, device=q.device)
            docs = None if document_ids is None else document_ids[idx, : offset + hi]
            o[idx, lo:hi] = causal_attention(q[idx, lo:hi], k[idx, : offset + hi], v[idx, : offset + hi], scale, docs)
    return o


def decode_attention(q: torch.Tensor, key: torch.Tensor, value: torch.Tensor, position: torch.Tensor,
                     document_start: Optional[torch.Tensor] = None, length: Optional[int] = None) -> torch.Tensor:
    """One query per sequence at ``position`` over a preallocated KV cache, without a host-side length unless
    ``length`` gives it.

    Args:
        q: [b, 1, h, d_k]; key: [b, capacity, h, d_k]; value: [b, capacity, h, d_v];
        position: long, the query's position (cache entries 0..position are read): 0-dim (every sequence's), or
            [b] (each sequence's own: a batch whose sequences stand at different positions).
        document_start: [b] long or None: the first position of each query's document (earlier
            entries, other documents', are not read).
        length: the largest position + 1 where the host knows it (an eager step; a CUDA graph replays the read
            without it): only the first ``length`` entries are read, and with one position and without
            ``document_start`` no mask is built.
    Returns:
        o [b, 1, h, d_v].
    """
    if length is not None:
        key, value = key[:, :length], value[:, :length]
        if document_start is None and position.dim() == 0:
            return F.scaled_dot_product_attention(q.transpose(1, 2), key.transpose(1, 2),
                                                  value.transpose(1, 2)).transpose(1, 2)
    positions = torch.arange(key.shape[1], device=key.device)
    visible = positions <= position.view(-1, 1)  # [1 or b, capacity]
    if document_start is not None:
        visible = visible & (positions >= document_start[:, None])
    if document_start is not None or position.dim() == 1:
        visible = visible[:, None, None]  # [b, 1, 1, capacity]
    o = F.scaled_dot_product_attention(
        q.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), attn_mask=visible,
    )  # [b, h, 1, d_v]
    return o.transpose(1, 2)


def attention_at(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                 document_ids: Optional[torch.Tensor] = None, scale: Optional[float] = None) -> torch.Tensor:
    """Causal attention for queries at a few positions of the sequence (the router's chunk ends).

    Args:
        q: [b, n, h, d_k], the queries of the tokens at ``positions`` [n] (long, increasing);
        k: [b, s, h, d_k]; v: [b, s, h, d_v]; document_ids: [b, s] int or None (a query reads its own
        document only).
    Returns:
        o [b, n, h, d_v]: query i reads the keys up to positions[i].
    """
    visible = torch.arange(k.shape[1], device=k.device)[None] <= positions[:, None]  # [n, s]
    if document_ids is not None:
        visible = (visible & (document_ids[:, positions, None] == document_ids[:, None, :]))[:, None]  # [b, 1, n, s]
    o = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=visible, scale=scale,
    )  # [b, h, n, d_v]
    return o.transpose(1, 2)
