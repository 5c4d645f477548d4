"""The FLOP model: what one training step computes, for MFU. The training log (``perf/tflops``,
``perf/mfu``) and ``benchmarks/bench_train_step.py`` both count with it.

Per step over n sequences of s tokens, L layers, h heads of d_k (keys, queries) and d_v (values):

    matmul     6 * P * s * n        P = weights of every linear layer, the output layer's included
                                    (tied: the embedding's), not the embedding lookup, norms, convs or
                                    per-head scalars; 6 = 2 (mul-add) x 3 (forward + 2 backward)
    attention  3 * s^2 * h * (d_k + d_v) * sum_l f_l * n
                                    = 2 (mul-add) x 3 (fwd + 2 bwd) x s^2/2 (causal half) x h x
                                    (d_k for QK^T + d_v for PV), per layer l weighted by f_l, the fraction
                                    of its query positions that read attention: 1 in a layer without a
                                    linear mixer (the Transformer's, a pattern's '*'), 0 in one without
                                    attention (Mamba-2, GDN), the modes' fraction in an Oryx block (it
                                    computes attention only for the query blocks that read it)
    scan       12 * s * h * d_k * d_v * L_lin * n   over the L_lin layers with a linear mixer, for every
                                    token (both memories absorb every token) = 2 (state update k v^T and
                                    read q^T S) x 2 (mul-add) x 3 (fwd + 2 bwd) x d_k x d_v per head and token

This is the useful work, not the work done: an Oryx layer computes whole 128-position query blocks
that hold a reader (a partly read block is credited less than it runs), the chunked scans spend more
than 12 d_k d_v per token, and recomputation is not counted (MFU, not HFU). The earlier training-log
count (dense attention for every token whatever the modes, no scan) over-credited Oryx models at low
attention fractions and under-credited Mamba-2 and GDN.
"""

import dataclasses

import torch
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

from oryx_megatron.layers.hidden_projection import HiddenProjection


@dataclasses.dataclass(frozen=True)
class StepShape:
    """What the FLOPs of one training step depend on."""

    matmul_params: int  # see matmul_params()
    num_layers: int
    heads: int
    d_k: int
    d_v: int
    seq: int
    sequences: int  # per step: a micro-batch (the benchmark) or the global batch (training)
    attention_layers: float  # sum over the layers of the fraction of their query positions that read attention
    scan_layers: int  # layers whose linear mixer scans every token

    @property
    def attention_fraction(self) -> float:
        """Of the query positions of every layer, those that read attention."""
        return self.attention_layers / self.num_layers


def matmul_flops(shape: StepShape) -> int:
    return 6 * shape.matmul_params * shape.seq * shape.sequences


def attention_flops(shape: StepShape) -> int:
    per_sequence_layer = 3 * shape.seq**2 * shape.heads * (shape.d_k + shape.d_v)
    return round(per_sequence_layer * shape.sequences * shape.attention_layers)


def scan_flops(shape: StepShape) -> int:
    return 12 * shape.seq * shape.heads * shape.d_k * shape.d_v * shape.scan_layers * shape.sequences


def train_step_flops(shape: StepShape) -> int:
    """Forward + backward FLOPs of one step (the module docstring has the formula)."""
    return matmul_flops(shape) + attention_flops(shape) + scan_flops(shape)


def matmul_params(model: torch.nn.Module) -> int:
    """Weights that multiply every token: those of every linear layer, the output layer's included
    (tied to the embedding, it has no weight of its own and uses the embedding's). ``model``: a model
    chunk, bare or wrapped (megatron's DDP / Float16Module: ``.module``); under tensor or pipeline
    parallelism this rank's share, to be summed over the ranks of one replica."""
    while hasattr(model, "module"):
        model = model.module
    total = 0
    for module in model.modules():
        if isinstance(module, (ColumnParallelLinear, RowParallelLinear, torch.nn.Linear)):
            weight = module.weight if module.weight is not None else model.shared_embedding_or_output_weight()
            total += weight.numel()
        elif isinstance(module, HiddenProjection) and module.tp_group.rank() == 0:  # replicated: once per replica
            total += module.weight.numel()
    return total


def attention_fraction(config, read_fraction: float) -> float:
    """f of one layer's attention term: 0 without attention, 1 without a linear mixer (every position reads
    attention whatever the modes), else ``read_fraction``, the fraction of query positions whose
    mode reads attention. ``config``: a layer's (``OryxConfig.layer_config``), or megatron's TransformerConfig
    (the baseline)."""
    if not getattr(config, "has_attention", True):
        return 0.0
    if getattr(config, "linear_mixer", None) is None:
        return 1.0
    return read_fraction


def step_shape(config, matmul_params: int, seq: int, sequences: int, read_fraction: float) -> StepShape:
    """The StepShape of ``sequences`` sequences of ``seq`` tokens through the model of ``config`` (each layer as its
    mixers are: ``model.layer_pattern``)."""
    return StepShape(
        matmul_params=matmul_params, num_layers=config.num_layers, heads=config.num_attention_heads,
        d_k=config.kv_channels, d_v=getattr(config, "value_head_dim", None) or config.kv_channels, seq=seq,
        sequences=sequences, attention_layers=attention_layers(config, read_fraction),
        scan_layers=sum(getattr(layer, "linear_mixer", None) is not None for layer in _layers(config)),
    )


def attention_layers(config, read_fraction: float) -> float:
    """The layers of ``config``'s model weighted by the fraction of their query positions that read attention
    (``attention_fraction`` of each layer's mixers, ``model.layer_pattern``), when the tokens' modes read it at
    ``read_fraction``; divided by the layers, the share of (layer, token) reads in attention that the evaluations
    report as ``attention_reads``."""
    return sum(attention_fraction(layer, read_fraction) for layer in _layers(config))


def _layers(config) -> list:
    """Each layer's config (an OryxConfig's ``layer_config``; the Transformer's layers are all alike)."""
    return [config.layer_config(i) if hasattr(config, "layer_config") else config for i in range(config.num_layers)]
