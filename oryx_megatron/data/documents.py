"""Document boundaries of packed token sequences.

A packed sample holds the end of one document, whole documents and the start of another,
each ended by the EOD token. ``document_ids`` numbers them per sequence: 0 for the first
(possibly partial) document, +1 at the token after each EOD (the EOD belongs to the document
it ends), Megatron's convention for ``reset_attention_mask`` / ``reset_position_ids``.
"""

import torch


def document_ids(tokens: torch.Tensor, eod_id: int) -> torch.Tensor:
    """int32 [..., s]: ``document_ids[..., t]`` = the number of ``eod_id`` tokens in
    ``tokens[..., :t]`` (an exclusive cumulative count along the last dimension)."""
    eod = (tokens == eod_id).to(torch.int32)  # [..., s]
    return eod.cumsum(-1, dtype=torch.int32) - eod
