"""``OryxCache``: the inference state of an ``OryxForCausalLM``, passed as ``past_key_values`` (``cache``).

Per layer the conv states of the convolved streams, the KV cache (rotated keys, values) and the
recurrent state, updated in place on every token whatever its mode; for the whole model the tokens
held (``seqlen``), where each sequence's current document starts (keys before it are not read) and the
last token fed (a model trained with ``data.reset_at_eod`` restarts every state after an EOD token).
The same states as megatron's ``MixerCache``, without the CUDA-graph bookkeeping.
"""

from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from oryx_megatron.hf.layout import conv_streams, mixer_streams

KV_BLOCK = 256  # KV positions allocated at a time


@dataclass
class OryxLayerCache:
    conv_states: Dict[str, Tensor]  # stream -> [b, h * width, conv_kernel - 1]
    key: Optional[Tensor]  # [b, capacity, h, d_k], rotated; None: no KV cache kept
    value: Optional[Tensor]  # [b, capacity, h, d_v]
    recurrent_state: Tensor  # [b, h, d_k, d_v], fp32 (or wider)

    def append(self, key: Tensor, value: Tensor, start: int) -> Tuple[Tensor, Tensor]:
        """Store s new tokens' key/value [b, s, h, d] at positions [start, start + s): (every key, every value)."""
        end = start + key.shape[1]
        if end > self.key.shape[1]:
            capacity = -(-end // KV_BLOCK) * KV_BLOCK
            self.key, self.value = (F.pad(t, (0, 0, 0, 0, 0, capacity - t.shape[1])) for t in (self.key, self.value))
        self.key[:, start:end] = key
        self.value[:, start:end] = value
        return self.key[:, :end], self.value[:, :end]


class OryxCache:
    """Everything an Oryx model remembers of the tokens it was fed; ``kv_cache=False`` keeps no keys and
    values (linear-only inference: a token reading attention is then refused)."""

    def __init__(self, config, batch_size: int, dtype: torch.dtype, device=None, kv_cache: bool = True):
        h, w = config.num_attention_heads, config.conv_kernel
        widths = mixer_streams(config)
        keep_kv = config.has_attention and kv_cache
        state_dtype = torch.promote_types(dtype, torch.float32)
        self.layers: List[OryxLayerCache] = []
        for _ in range(config.num_hidden_layers):
            conv = {s: torch.zeros(batch_size, h * widths[s], w - 1, dtype=dtype, device=device)
                    for s in conv_streams(config)}
            key = torch.zeros(batch_size, KV_BLOCK, h, config.head_dim, dtype=dtype, device=device) if keep_kv else None
            value = torch.zeros(batch_size, KV_BLOCK, h, config.value_head_dim, dtype=dtype, device=device) \
                if keep_kv else None
            state = torch.zeros(batch_size, h, config.head_dim, config.value_head_dim, dtype=state_dtype, device=device)
            self.layers.append(OryxLayerCache(conv, key, value, state))
        self.batch_size = batch_size
        self.seqlen = 0
        self.document_start = torch.zeros(batch_size, dtype=torch.long, device=device)
        self.last_tokens: Optional[Tensor] = None  # [b]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Tokens held (transformers' generate slices a prompt continuing the cache by it)."""
        return self.seqlen

    @property
    def is_linear(self) -> List[bool]:
        """Per layer, whether transformers' generate should skip slicing by ``get_seq_length``: never, every
        layer counts every token it absorbed."""
        return [False] * len(self.layers)

    @property
    def position(self) -> Tensor:
        """``seqlen`` as a 0-dim tensor on the cache's device."""
        return torch.tensor(self.seqlen, device=self.document_start.device)

    def start_documents(self, starting: Tensor) -> None:
        """The next token of the sequences where ``starting`` [b] bool starts a document: their conv and
        recurrent states restart from zero and attention reads from here on."""
        keep = ~starting
        for layer in self.layers:
            for state in layer.conv_states.values():
                state.mul_(keep[:, None, None].to(state.dtype))
            layer.recurrent_state.mul_(keep[:, None, None, None].to(layer.recurrent_state.dtype))
        self.document_start = torch.where(starting, self.seqlen, self.document_start)

    def key_document_ids(self, document_ids: Tensor) -> Tensor:
        """Document ids [b, seqlen + s] of the cached keys and of s new tokens with ``document_ids`` [b, s]:
        a cached key of the current document gets the first new token's id, earlier ones -1."""
        cached = torch.arange(self.seqlen, device=document_ids.device)[None] >= self.document_start[:, None]
        return torch.cat([torch.where(cached, document_ids[:, :1], -1), document_ids], dim=1)

    def advance(self, n_tokens: int, last_tokens: Optional[Tensor], document_ids: Optional[Tensor]) -> None:
        """After a forward of ``n_tokens`` tokens per sequence, the last ones ``last_tokens`` [b], in
        documents ``document_ids`` [b, n_tokens] (None: one): the current document starts at the last
        document start among them, and they are held."""
        if document_ids is not None:
            starts = F.pad(document_ids[:, 1:] != document_ids[:, :-1], (1, 0))  # [b, s]
            index = torch.arange(starts.shape[1], device=starts.device)
            last = torch.where(starts, index, -1).amax(1)  # [b], -1: no new document
            self.document_start = torch.where(last >= 0, self.seqlen + last, self.document_start)
        self.seqlen += n_tokens
        self.last_tokens = last_tokens
