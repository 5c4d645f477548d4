"""The layer RMSNorm of the local backend (the mixer output's per-head gated norm is ``ops.gated_rms_norm``)."""

import torch

from oryx_megatron.layers.config import OryxConfig


class RMSNorm(torch.nn.RMSNorm):
    """torch RMSNorm with megatron's norm signature; sequence-parallel aware.

    Under sequence parallelism each TP rank sees a slice of the sequence, so the
    weight is flagged ``sequence_parallel`` and megatron all-reduces its grad over TP
    (megatron's ``WrappedTorchNorm`` refuses sequence parallelism instead).
    """

    def __init__(self, config: OryxConfig, hidden_size: int, eps: float = 1e-5):
        super().__init__(hidden_size, eps=eps, dtype=config.params_dtype)
        self.weight.sequence_parallel = config.sequence_parallel
