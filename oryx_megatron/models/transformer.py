"""The Transformer baseline: megatron's GPTModel (RoPE, SwiGLU, RMSNorm) with OryxModel's call signature,
decoding with megatron's own KV cache.

Cached decoding goes through megatron's static inference path (``StaticInferenceContext``: per layer a
[capacity, b, groups, d] key and value buffer that each attention layer appends to, rotary angles of the
absolute positions). ``TransformerCache`` holds that context behind the cache interface the generation
loop calls (``reserve``, ``snapshot`` / ``restore``, ``start_documents``, ``nbytes``, ``seqlen``,
``position``): one cache for every layer, so ``allocate_inference_cache`` returns a list of one. A model of
megatron's local spec reads its layers and these buffers directly (``transformer_step``: megatron's per-call
plumbing costs more than a tiny model's arithmetic), keeping the keys rotated; any other model decodes
through megatron's forward, which keeps them unrotated.

Masks: megatron masks a prefill causally and lets a one-token step read every cached key; packed
documents (``document_ids``, ``start_documents``) and a multi-token call on a filled cache get an explicit
mask [b, 1, s, cached + s] instead, read by ``cached_step``'s SDPA or, for a model it does not compute, by the
local spec's core attention (with the Transformer Engine spec they are refused in one line). The baseline reads
attention only: no linear mode, no cache without keys and values, no CUDA graphs (the generation loop says so).
"""

from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer.transformer_layer import TransformerLayer, get_transformer_layer_offset
from torch import Tensor

from oryx_megatron.compat.megatron import last_token_logits_only, static_inference_context
from oryx_megatron.layers.gpt_attention import CausalSDPAttention
from oryx_megatron.models.layer_init import layer_init_rng
from oryx_megatron.mixer.state import kv_capacity
from oryx_megatron.models.transformer_step import cached_step, rotary_tables, supports
from oryx_megatron.ops.chunking import document_starts


@dataclass
class TransformerSnapshot:
    """What ``TransformerCache.restore`` needs to return to an earlier position."""

    seqlen: int
    document_start: Tensor
    documents: bool


class TransformerCache:
    """Every layer's keys and values in megatron's static inference context, and the document each sequence
    is in. ``seqlen``: tokens cached so far (megatron's ``sequence_len_offset``); ``position``: the same as a
    device tensor; ``document_start`` [b]: where each sequence's current document starts."""

    def __init__(self, model: GPTModel, batch_size: int, dtype: torch.dtype, device, capacity: Optional[int]):
        capacity = kv_capacity(capacity)
        self.context = static_inference_context(batch_size, capacity)
        for layer in model.decoder.layers:  # preallocated, so that nbytes and reserve see them before any forward
            attention = layer.self_attention
            shape = (capacity, batch_size, attention.num_query_groups_per_partition,
                     attention.hidden_size_per_attention_head)
            self.context.key_value_memory_dict[attention.layer_number] = (
                torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
        self.position = torch.zeros((), dtype=torch.long, device=device)
        self.document_start = torch.zeros(batch_size, dtype=torch.long, device=device)
        self.documents = False  # whether documents were ever given: then every call gets an explicit mask
        self.dtype, self.tables = dtype, None  # cached_step's rotary cos, sin of the capacity (made on first use)

    @property
    def seqlen(self) -> int:
        return self.context.sequence_len_offset

    @property
    def capacity(self) -> int:
        return self.context.max_sequence_length

    def reserve(self, n_tokens: int) -> bool:
        """Room for ``n_tokens`` in all (grown in whole KV blocks, ``kv_capacity``); True when the buffers were
        reallocated."""
        if n_tokens <= self.capacity:
            return False
        capacity = kv_capacity(n_tokens)
        buffers = self.context.key_value_memory_dict
        for layer_number, pair in buffers.items():
            grown = []
            for old in pair:
                new = old.new_zeros(capacity, *old.shape[1:])
                new[: self.seqlen] = old[: self.seqlen]
                grown.append(new)
            buffers[layer_number] = tuple(grown)
        self.context.max_sequence_length = capacity  # also the length of megatron's rotary table
        return True

    def rotary(self, model) -> Tuple[Tensor, Tensor]:
        """cos, sin [capacity, 1, 1, d] of ``cached_step`` (``transformer_step.rotary_tables``), kept per capacity."""
        if self.tables is None or self.tables[0].shape[0] != self.capacity:
            self.tables = rotary_tables(model, self.capacity, self.dtype)
        return self.tables

    def start_documents(self, starting: Tensor) -> None:
        """The next token of the sequences where ``starting`` [b] bool starts a new document: attention reads
        from there on (RoPE is relative, so a document read alone at any offset is the document alone)."""
        self.documents = True
        self.document_start.copy_(torch.where(starting, self.position, self.document_start))

    def attention_mask(self, s: int, document_ids: Optional[Tensor]) -> Optional[Tensor]:
        """megatron's attention_mask [b, 1, s, seqlen + s] (True: not read) for s new tokens with
        ``document_ids`` [b, s] (their first token continues the cached document); None where megatron's own
        masking is right (no documents, and a prefill or a one-token step)."""
        self.documents = self.documents or document_ids is not None
        if not self.documents and (self.seqlen == 0 or s == 1):
            return None
        offset, device = self.seqlen, self.position.device
        starts = self.document_start[:, None].expand(-1, s)  # [b, s]: each new token's document start
        if document_ids is not None:
            new = document_starts(document_ids)  # [b, s]
            first = torch.where(new, torch.arange(s, device=device), 0).cummax(dim=1).values  # 0: no new document
            starts = torch.where(first > 0, offset + first, starts)
        keys = torch.arange(offset + s, device=device)
        queries = offset + torch.arange(s, device=device)
        read = (keys[None, None] <= queries[None, :, None]) & (keys[None, None] >= starts[:, :, None])
        return ~read[:, None]  # [b, 1, s, offset + s]

    def advance(self, n_tokens: int, mask: Optional[Tensor]) -> None:
        """After a forward of ``n_tokens`` tokens: the last one's document start is the cache's."""
        if mask is not None:
            self.document_start.copy_((~mask[:, 0, -1]).int().argmax(dim=1))  # its first readable key
        self.context.increment_sequence_len_offset(n_tokens)
        self.position += n_tokens

    def snapshot(self) -> TransformerSnapshot:
        return TransformerSnapshot(self.seqlen, self.document_start.clone(), self.documents)

    def restore(self, snapshot: TransformerSnapshot) -> None:
        """Back to the snapshot's position, in place (keys past it are overwritten later)."""
        self.context.sequence_len_offset = snapshot.seqlen
        self.position.fill_(snapshot.seqlen)
        self.document_start.copy_(snapshot.document_start)
        self.documents = snapshot.documents

    def nbytes(self) -> Dict[str, int]:
        """Allocated bytes: kv / recurrent / conv (a Transformer has only keys and values)."""
        kv = sum(t.nbytes for pair in self.context.key_value_memory_dict.values() for t in pair)
        return {"kv": kv, "recurrent": 0, "conv": 0}


class LayerSeededTransformerLayer(TransformerLayer):
    """megatron's TransformerLayer whose initial weights depend only on the seed and its global number
    (``layer_init_rng``), as OryxModel's layers: a stage of a pipeline builds the layers one process builds."""

    def __init__(self, config, submodules, layer_number: int = 1, **kwargs):
        with layer_init_rng(layer_number + get_transformer_layer_offset(config, kwargs.get("vp_stage"))):
            super().__init__(config, submodules, layer_number=layer_number, **kwargs)


class TransformerBaseline(GPTModel):
    """megatron's GPTModel (RoPE, SwiGLU, RMSNorm) with OryxModel's call signature.

    ``modes`` is accepted and ignored: a Transformer reads every token with attention.
    No attention mask is built but for packed documents: both specs' core attention is causal by its
    mask type.
    """

    def __init__(self, config, transformer_layer_spec, **kwargs):
        super().__init__(config, transformer_layer_spec, position_embedding_type="rope", **kwargs)
        self.direct_step = supports(self)  # cached calls by ``transformer_step.cached_step``

    def forward(self, input_ids, modes=None, labels=None, inference_cache: Optional[List[TransformerCache]] = None,
                last_token_logits: bool = False, document_ids=None):
        """``document_ids`` [b, s] (packed documents): attention within each document, as megatron's
        attention_mask [b, 1, s, s] (True: not read). With ``inference_cache`` (``allocate_inference_cache``'s),
        the tokens continue the cached ones: logits [b, s, V], or [b, 1, V] of the last position with
        ``last_token_logits``."""
        if inference_cache is not None:
            return self._cached_forward(input_ids, inference_cache[0], last_token_logits, document_ids)
        mask = None
        if document_ids is not None:
            s = document_ids.shape[1]
            causal = torch.ones(s, s, dtype=torch.bool, device=document_ids.device).tril()
            mask = ~(causal & (document_ids[:, :, None] == document_ids[:, None, :]))[:, None]
        logits = super().forward(input_ids, position_ids=None, attention_mask=mask, labels=labels)
        return logits[:, -1:] if last_token_logits and labels is None else logits

    def _cached_forward(self, input_ids: Tensor, cache: TransformerCache, last_token_logits: bool,
                        document_ids: Optional[Tensor]) -> Tensor:
        if self.training:
            raise ValueError("the Transformer baseline decodes with its cache in eval mode (model.eval())")
        s = input_ids.shape[1]
        cache.reserve(cache.seqlen + s)
        mask = cache.attention_mask(s, document_ids)
        if self.direct_step:  # megatron's layers read directly; the cache's keys kept rotated
            return cached_step(self, input_ids, cache, mask, last_token_logits)
        if mask is not None and not isinstance(self.decoder.layers[0].self_attention.core_attention,
                                               CausalSDPAttention):
            raise ValueError("the Transformer baseline reads packed documents (reset_at_eod) and several new tokens "
                             "on a filled cache with model.transformer_impl=local only (an explicit mask)")
        last_token_logits_only(cache.context, last_token_logits)
        logits = super().forward(input_ids, position_ids=None, attention_mask=mask, inference_context=cache.context,
                                 runtime_gather_output=True)  # megatron's inference path asks for it (TP=1: a no-op)
        cache.advance(s, mask)
        return logits[:, -1:] if last_token_logits else logits  # megatron materialises all positions in training mode

    def allocate_inference_cache(self, batch_size: int, dtype: torch.dtype, device=None,
                                 capacity: Optional[int] = None, kv_cache: bool = True) -> List[TransformerCache]:
        """One cache for every layer (megatron's static inference context), of ``capacity`` positions (default
        one KV block; grown when exceeded). Refused: ``kv_cache=False`` (attention needs its keys and values) and
        tensor parallelism (megatron's inference path returns gathered logits; checkpoints load at TP=1)."""
        if not kv_cache:
            raise ValueError("the Transformer baseline reads attention only and needs its KV cache "
                             "(kv_cache=False / --no-kv-cache is for linear-only decoding of Oryx models)")
        if self.config.tensor_model_parallel_size != 1:
            raise ValueError(f"the Transformer baseline decodes at tensor_model_parallel_size=1, "
                             f"got {self.config.tensor_model_parallel_size}")
        return [TransformerCache(self, batch_size, dtype, device, capacity)]
