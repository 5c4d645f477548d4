"""megatron's token embedding of the Oryx model, plain at TP=1 without autograd: the reason of layers/linear.py.

megatron's ``LanguageModelEmbedding.forward`` opens an NVTX range, calls the vocab-parallel embedding (its tensor-
parallel reduction an autograd Function even on one rank), transposes, and calls its dropout module: at a decode step
of a tiny model that costs more than the lookup. Where nothing is parallel, differentiated or dropped out, the forward
here is one ``F.embedding`` and the transpose to [s, b, hidden]; otherwise it is megatron's own. Parameters, names and
checkpoints are megatron's (a subclass).
"""

from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core.models.common.embeddings.language_model_embedding import LanguageModelEmbedding
from torch import Tensor

from oryx_megatron.layers.linear import rematerialised


class TokenEmbedding(LanguageModelEmbedding):
    """``LanguageModelEmbedding`` of token embeddings only (no position or token-type embedding), plain at TP=1
    without autograd and without dropout at work."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        c = self.config
        self.solo = (self.tp_group.size() == 1 and not self.add_position_embedding and self.num_tokentypes == 0
                     and not c.sequence_parallel and not c.fp32_residual_connection
                     and not rematerialised(self.word_embeddings))

    def forward(self, input_ids: Tensor, position_ids: Optional[Tensor] = None, tokentype_ids=None) -> Tensor:
        """input_ids [b, s] -> [s, b, hidden]."""
        dropout = self.training and self.embedding_dropout.p > 0
        if not self.solo or torch.is_grad_enabled() or dropout or tokentype_ids is not None:
            return super().forward(input_ids, position_ids, tokentype_ids)
        return F.embedding(input_ids, self.word_embeddings.weight).transpose(0, 1).contiguous()
