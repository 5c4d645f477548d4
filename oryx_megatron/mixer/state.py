"""The per-layer inference state of the Oryx mixer (``MixerCache``): conv states, KV cache, recurrent state and
document bookkeeping, updated in place on every token whatever its mode; snapshots to return to an earlier
position (speculative decoding, router decisions at decode)."""

from dataclasses import dataclass
from typing import Dict, Optional, Protocol, Tuple

import torch
from torch import Tensor

from oryx_megatron.ops.chunking import document_starts

KV_BLOCK = 256  # KV cache positions allocated at a time

State = Dict[str, Tensor]  # a linear mixer's recurrent state: name -> [b, h, ...] (``LinearMixer.state_spec``)


def kv_capacity(n_tokens: Optional[int] = None) -> int:
    """KV cache positions that hold ``n_tokens`` (default one block): whole blocks of KV_BLOCK."""
    return -(-(n_tokens or KV_BLOCK) // KV_BLOCK) * KV_BLOCK


@dataclass
class MixerSnapshot:
    """What ``MixerCache.restore`` needs to return to an earlier position (speculative decoding)."""

    conv_state: Tensor
    recurrent_state: State
    document_start: Tensor
    seqlen: int


class EngineKV(Protocol):
    """A serving engine's kernels over its pages of keys and values, in a layout of their own (vLLM's CPU attention
    keeps keys transposed within a page): the core hands them the batch's tokens and reads through them."""

    def write(self, key: Tensor, value: Tensor) -> None:
        """Store the batch's next s tokens' key, value [b, s, h, d] (rotated) at their positions."""

    def attend(self, query: Tensor) -> Tensor:
        """Queries [b, s, h, d_k] (rotated) of those s tokens -> [b, s, h, d_v]: causal softmax attention over
        every key of the sequence written so far (one document)."""


@dataclass
class MixerCache:
    """Inference state of one layer, updated in place on every token whatever its mode.

    Keys and values live in preallocated buffers of ``capacity`` positions (grown by KV_BLOCK
    when a prefill or ``reserve`` needs more); the first ``seqlen`` hold the tokens so far.
    ``position`` is ``seqlen`` as a device tensor: the one-token step reads and advances only it,
    so that step can be captured in a CUDA graph (a replay leaves ``seqlen`` to the caller).

    A serving engine keeps keys and values in pages: with ``block_table`` [b, n] the buffers are [pages, page
    size, h, d], shared by every sequence of the engine, and sequence i's position p lives in page
    ``block_table[i, p // page size]`` at ``p % page size`` (written in place; the engine allocates the pages, so a
    sequence holds memory for the tokens it has). Its decode step batches sequences that stand at different
    positions: ``position`` [b] holds each one's (``seqlen`` is then the largest). Where the engine's own kernels
    write and read its pages, in their layout, ``engine_kv`` does both (``EngineKV``).
    """

    conv_state: Tensor  # [b, h * conv width, conv_kernel - 1]: the conv streams' last inputs (OryxMixer._conv)
    key: Optional[Tensor]  # [b, capacity, h, d_k], rotated ([pages, page size, h, d_k] with block_table); None: no
    value: Optional[Tensor]  # [b, capacity, h, d_v]                                         KV cache kept
    recurrent_state: State  # name -> [b, h, ...] fp32 or wider (LinearMixer.state_spec); empty: attention only
    position: Tensor  # 0-dim long, on the device; [b]: each sequence's own (see above; the one-token step only)
    document_start: Tensor  # [b] long: where each sequence's current document starts (keys before it are not read)
    seqlen: int = 0
    documents: bool = False  # a document may have started after position 0: document_start is read (host-side)
    conv_weight: Optional[Tensor] = None  # the layer's joint conv weight (OryxMixer._conv_weight), made at its first
    # step and kept: a model's weights do not change while one of its caches is in use (a generation)
    block_table: Optional[Tensor] = None  # [b, n] long: each sequence's pages of key / value (see above); None:
    # row i of key / value is sequence i
    engine_kv: Optional["EngineKV"] = None  # an engine's kernels write and read the pages, in their own layout

    @property
    def capacity(self) -> int:
        if self.key is None:
            return 0
        return self.key.shape[1] * (1 if self.block_table is None else self.block_table.shape[1])

    def reserve(self, n_tokens: int) -> bool:
        """Room for ``n_tokens`` in all; True when the buffers were reallocated (which invalidates a
        captured graph). An engine's pages are its own: past them is an error."""
        if self.key is None or n_tokens <= self.capacity:
            return False
        if self.block_table is not None:
            raise ValueError(f"{n_tokens} positions do not fit the {self.capacity} of the sequences' pages")
        capacity = kv_capacity(n_tokens)
        for name in ("key", "value"):
            old = getattr(self, name)
            new = old.new_zeros(old.shape[0], capacity, *old.shape[2:])
            new[:, : self.seqlen] = old[:, : self.seqlen]
            setattr(self, name, new)
        return True

    def append(self, key: Tensor, value: Tensor) -> None:
        """Store s new tokens' key/value [b, s, h, d] after the cached ones (``cached`` reads them)."""
        end = self.seqlen + key.shape[1]
        self.reserve(end)
        if self.engine_kv is not None:
            self.engine_kv.write(key, value)
        elif self.block_table is not None:
            self._write_pages(torch.arange(self.seqlen, end, device=key.device).expand(key.shape[0], -1), key, value)
        else:
            self.key[:, self.seqlen : end] = key
            self.value[:, self.seqlen : end] = value

    def write_at_position(self, key: Tensor, value: Tensor) -> None:
        """Store one token's key/value [b, 1, h, d] at ``position`` (no host-side index)."""
        if self.engine_kv is not None:
            self.engine_kv.write(key, value)
        elif self.block_table is not None:
            self._write_pages(self.position.expand(key.shape[0])[:, None], key, value)
        elif self.position.dim() == 0:
            index = self.position.view(1)
            self.key.index_copy_(1, index, key)
            self.value.index_copy_(1, index, value)
        else:
            rows = torch.arange(key.shape[0], device=key.device)
            self.key[rows, self.position] = key[:, 0]
            self.value[rows, self.position] = value[:, 0]

    def cached(self, length: Optional[int] = None) -> Tuple[Tensor, Tensor]:
        """The sequences' keys and values [b, length (None: capacity), h, d] (copied out of their pages)."""
        if self.block_table is None:
            return self.key[:, :length], self.value[:, :length]
        size = self.key.shape[1]
        pages = self.block_table[:, : None if length is None else -(-length // size)]  # [b, n]
        return tuple(t[pages].flatten(1, 2)[:, :length] for t in (self.key, self.value))  # [b, n * size, h, d]

    def _write_pages(self, positions: Tensor, key: Tensor, value: Tensor) -> None:
        """Store key/value [b, s, h, d] at the sequences' positions [b, s], in page ``block_table[i, p // size]`` at
        ``p % size``."""
        size = self.key.shape[1]
        pages, offsets = self.block_table.gather(1, positions // size), positions % size
        self.key[pages, offsets] = key
        self.value[pages, offsets] = value

    def initial_conv_state(self) -> Optional[Tensor]:
        """The conv state a prefill continues from: None before the first token (zero padding)."""
        return self.conv_state if self.seqlen > 0 else None

    def absorb(self, conv_state: Tensor, recurrent_state: Optional[State], n_tokens: int,
               document_ids: Optional[Tensor] = None) -> None:
        """After ``n_tokens`` new tokens (their keys and values already written): their final conv state [b, h * conv
        width, conv_kernel - 1] and recurrent state (name -> tensor, the names the cache holds; None: attention only),
        copied in place; with ``document_ids`` [b, n_tokens] the current document's start moves to the last one
        among them."""
        self.conv_state.copy_(conv_state)
        if recurrent_state is not None:
            if recurrent_state.keys() != self.recurrent_state.keys():
                raise ValueError(f"the linear mixer returned the state {sorted(recurrent_state)}; its state_spec "
                                 f"declares {sorted(self.recurrent_state)}")
            for name, tensor in recurrent_state.items():
                self.recurrent_state[name].copy_(tensor)
        if document_ids is not None:
            self.after_documents(document_ids)
        self.advance(n_tokens)

    def advance(self, n_tokens: int) -> None:
        self.seqlen += n_tokens
        self.position += n_tokens

    def start_documents(self, starting: Tensor) -> None:
        """The next token of the sequences where ``starting`` [b] bool starts a new document: their
        conv and recurrent states restart from zero and attention reads from here on. In place, no host
        sync (a captured decode graph reads the same buffers)."""
        self.documents = True
        keep = ~starting
        for state in (self.conv_state, *self.recurrent_state.values()):  # [b, ...] each
            state.mul_(keep.view(-1, *(1,) * (state.dim() - 1)).to(state.dtype))
        self.document_start.copy_(torch.where(starting, self.position, self.document_start))

    def key_document_ids(self, document_ids: Tensor) -> Tensor:
        """Document ids [b, seqlen + s] of the cached keys and of s new tokens with ``document_ids``
        [b, s]: a cached key of the current document has the first new token's id, earlier ones -1."""
        cached = torch.arange(self.seqlen, device=document_ids.device)[None] >= self.document_start[:, None]
        return torch.cat([torch.where(cached, document_ids[:, :1], -1), document_ids], dim=1)

    def after_documents(self, document_ids: Tensor) -> None:
        """Move ``document_start`` to the last document start among s new tokens (before ``advance``)."""
        self.documents = True
        starts = document_starts(document_ids)  # [b, s]
        index = torch.arange(starts.shape[1], device=starts.device)
        last = torch.where(starts, index, -1).amax(1)  # [b], -1: no new document
        self.document_start.copy_(torch.where(last >= 0, self.seqlen + last, self.document_start))

    def snapshot(self) -> MixerSnapshot:
        """Copies of the states that tokens overwrite (cached keys past ``seqlen`` are ignored later)."""
        recurrent = {name: state.clone() for name, state in self.recurrent_state.items()}
        return MixerSnapshot(self.conv_state.clone(), recurrent, self.document_start.clone(), self.seqlen)

    def restore(self, snapshot: MixerSnapshot) -> None:
        """Back to the snapshot's position, in place."""
        self.conv_state.copy_(snapshot.conv_state)
        for name, state in snapshot.recurrent_state.items():
            self.recurrent_state[name].copy_(state)
        self.document_start.copy_(snapshot.document_start)
        self.seqlen = snapshot.seqlen
        self.position.fill_(snapshot.seqlen)

    def nbytes(self) -> Dict[str, int]:
        """Allocated bytes: kv / recurrent (every tensor of the state) / conv."""
        kv = 0 if self.key is None else self.key.nbytes + self.value.nbytes
        rec = sum(state.nbytes for state in self.recurrent_state.values())
        return {"kv": kv, "recurrent": rec, "conv": self.conv_state.nbytes}
