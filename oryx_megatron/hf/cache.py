"""``OryxCache``: the inference state of an ``OryxForCausalLM``, passed as ``past_key_values`` (``cache``).

One ``oryx_megatron.mixer.MixerCache`` per layer (conv states, KV cache, recurrent state and document
bookkeeping, updated in place on every token whatever its mode: the same states as megatron's inference),
plus what transformers' ``generate`` asks of a cache and the last token fed (a model trained with
``data.reset_at_eod`` restarts every state after an EOD token).
"""

from typing import List, Optional

from torch import Tensor

from oryx_megatron.mixer import MixerCache


class OryxCache:
    """Everything an Oryx model remembers of the tokens it was fed; made by ``OryxForCausalLM.allocate_cache``
    (``kv_cache=False`` keeps no keys and values: linear-only inference, a token reading attention is refused)."""

    def __init__(self, layers: List[MixerCache]):
        self.layers = layers
        self.last_tokens: Optional[Tensor] = None  # [b]

    @property
    def seqlen(self) -> int:
        """Tokens held."""
        return self.layers[0].seqlen

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Tokens held (transformers' generate slices a prompt continuing the cache by it)."""
        return self.seqlen

    @property
    def is_linear(self) -> List[bool]:
        """Per layer, whether transformers' generate should skip slicing by ``get_seq_length``: never, every
        layer counts every token it absorbed."""
        return [False] * len(self.layers)

    def start_documents(self, starting: Tensor) -> None:
        """The next token of the sequences where ``starting`` [b] bool starts a document: every layer's conv and
        recurrent states restart from zero and attention reads from here on."""
        for layer in self.layers:
            layer.start_documents(starting)
