"""``MixerContext``: what every layer of one forward shares, computed once by the model and handed down, as
megatron hands down ``PackedSeqParams``: the tokens' modes and the mixers they read, the block-sparse
attention read, the router's weights, the packed documents."""

import dataclasses
from typing import FrozenSet, List, Optional, Sequence, Union

import torch
from torch import Tensor

from oryx_megatron.config import MixerConfig, Mode
from oryx_megatron.ops import BlockReads, Documents

QUERY_BLOCK = 128  # query positions per block of the block-sparse attention read (FlexAttention's default)


@dataclasses.dataclass
class RouterReadouts:
    """The router's features, collected on the way (mixer/router.py): every layer a context carrying this passes
    through appends both mixers' reads of the first token of each chunk of ``chunk_size`` positions, [b, n, h, 2,
    d_v] (n = ceil(s / chunk_size); one token at decode: n = 1), computed from the same projections, convs and
    linear scan as the layer's own output."""

    chunk_size: int
    reads: List[Tensor] = dataclasses.field(default_factory=list)

    def stacked(self) -> Tensor:
        """[b, n, h, layers, 2, d_v]: the layers' reads, in the order they were read."""
        return torch.stack(self.reads, dim=3)


@dataclasses.dataclass(frozen=True)
class MixerContext:
    """``modes``: one Mode every token reads, or [b, s] int per token; ``reads``: the modes some token reads;
    ``attention_readers``: the block-sparse attention read where the tokens' modes differ (None: attention, if
    read, is computed for every position); ``router_weights`` [b, s] float, 0/1 in value with a gradient to the
    router (joint routing: out = linear + w (attention - linear)); ``documents``: packed documents or None;
    ``readouts``: where the layers leave the router's features (``RouterReadouts``), or None."""

    modes: Union[Mode, Tensor]
    reads: FrozenSet[Mode]
    attention_readers: Optional[BlockReads] = None
    router_weights: Optional[Tensor] = None
    documents: Optional[Documents] = None
    readouts: Optional[RouterReadouts] = None

    @classmethod
    def build(cls, config: MixerConfig, modes: Union[None, int, Mode, Tensor] = None,
              document_ids: Optional[Tensor] = None, router_weights: Optional[Tensor] = None,
              decode: bool = False) -> "MixerContext":
        """The context of one forward of a model with ``config``'s mixers. ``modes``: a Mode, [b, s] per token
        (one host sync finds the modes read), or None for a single-mixer model (which reads its one mixer
        whatever modes says); ``router_weights`` [b, s] instead of modes (joint routing: both mixers read
        everywhere); ``decode``: one token per sequence after cached ones, modes [b, 1] (or [b]) read without
        a host sync (both mixers compute, each sequence selects its own: a CUDA graph replays any modes)."""
        documents = None if document_ids is None else Documents(document_ids)
        if not config.is_multi_mixer:
            return cls._one_mixer(config, documents)
        if router_weights is not None:
            hard = torch.where(router_weights.detach() > 0.5, Mode.ATTENTION, Mode.LINEAR).to(torch.int8)
            return cls(hard, frozenset(Mode), router_weights=router_weights, documents=documents)
        if modes is None:
            raise ValueError(f"modes [batch, seq] is required by a multi-mixer model (mixers={config.mixers!r})")
        if not torch.is_tensor(modes):
            mode = Mode(int(modes))
            return cls(mode, frozenset((mode,)), documents=documents)
        if decode:
            return cls(modes.reshape(-1, 1), frozenset(Mode), documents=documents)
        reads = frozenset(Mode(int(m)) for m in torch.unique(modes).tolist())
        if len(reads) == 1:
            mode = next(iter(reads))
            return cls(mode, reads, documents=documents)
        return cls(modes, reads, BlockReads(modes == Mode.ATTENTION, QUERY_BLOCK), documents=documents)

    def for_layers(self, layers: Sequence[MixerConfig]) -> List["MixerContext"]:
        """The context of each layer of ``layers`` (their configs, ``MixerConfig.layer_config``), derived once
        per kind of layer (``read_by``)."""
        kinds = {}
        for layer in layers:
            if layer.mixers not in kinds:
                kinds[layer.mixers] = self.read_by(layer)
        return [kinds[layer.mixers] for layer in layers]

    def read_by(self, layer: MixerConfig) -> "MixerContext":
        """The context of a layer with ``layer``'s mixers (``MixerConfig.layer_config``): this one for an Oryx
        block; a single-mixer layer of a layer pattern reads its one mixer whatever the tokens' modes."""
        return self if layer.is_multi_mixer else self._one_mixer(layer, self.documents)

    @classmethod
    def _one_mixer(cls, config: MixerConfig, documents: Optional[Documents]) -> "MixerContext":
        mode = Mode.ATTENTION if config.has_attention else Mode.LINEAR
        return cls(mode, frozenset((mode,)), documents=documents)

    @property
    def document_ids(self) -> Optional[Tensor]:
        return None if self.documents is None else self.documents.ids
