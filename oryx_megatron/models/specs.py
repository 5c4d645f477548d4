"""Layer specs: which module implements each part, per backend.

``local`` runs anywhere (megatron tensor_parallel linears and MLP, plain at TP=1 without autograd: layers/linear.py,
layers/mlp.py; torch RMSNorm, SDPA);
``transformer_engine`` swaps in TE's linears, norm and fused attention without
touching the model code (CUDA + TE only; its parity check runs on a GPU machine).
"""

from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec

from oryx_megatron.layers.attention import TEAttention
from oryx_megatron.layers.linear import ColumnLinear, RowLinear
from oryx_megatron.layers.mlp import MLP as LocalMLP
from oryx_megatron.layers.multi_mixer import MultiMixer, MultiMixerSubmodules
from oryx_megatron.layers.norms import RMSNorm
from oryx_megatron.layers.oryx_layer import OryxLayer, OryxLayerSubmodules
from oryx_megatron.mixer.attention import SDPAttention


def _layer_spec(norm, column_linear, row_linear, core_attention, mlp=MLP) -> ModuleSpec:
    return ModuleSpec(
        module=OryxLayer,
        submodules=OryxLayerSubmodules(
            input_layernorm=norm,
            mixer=ModuleSpec(
                module=MultiMixer,
                submodules=MultiMixerSubmodules(
                    in_proj=column_linear, core_attention=core_attention, out_proj=row_linear
                ),
            ),
            pre_mlp_layernorm=norm,
            mlp=ModuleSpec(
                module=mlp,
                submodules=MLPSubmodules(linear_fc1=column_linear, linear_fc2=row_linear),
            ),
        ),
    )


def get_oryx_layer_local_spec() -> ModuleSpec:
    return _layer_spec(RMSNorm, ColumnLinear, RowLinear, SDPAttention, LocalMLP)


def get_oryx_layer_te_spec() -> ModuleSpec:
    from megatron.core.extensions.transformer_engine import (
        TEColumnParallelLinear,
        TENorm,
        TERowParallelLinear,
    )

    return _layer_spec(TENorm, TEColumnParallelLinear, TERowParallelLinear, TEAttention)


def get_oryx_layer_spec(transformer_impl: str) -> ModuleSpec:
    """'local' or 'transformer_engine' (OryxConfig.transformer_impl)."""
    if transformer_impl == "transformer_engine":
        return get_oryx_layer_te_spec()
    return get_oryx_layer_local_spec()
