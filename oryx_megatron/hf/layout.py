"""The weight layout that the Hugging Face model, export and import share: megatron parameter name <-> Hugging
Face name(s) (``oryx_rules`` / ``LLAMA_RULES``), with the split of a fused megatron tensor into its Hugging Face
parts (SwiGLU's ``linear_fc1`` into gate and up, the Transformer's ``linear_qkv`` into q, k, v) and the join
back. The Oryx mixer and router are the same modules on both sides (``oryx_megatron.mixer``): their rules
are their parameter names, under either model's prefix.

A model part without a rule fails export and import by name.
"""

import re
from dataclasses import dataclass
from typing import Callable, Dict, List, Mapping, Optional, Tuple

import torch
from torch import Tensor

from oryx_megatron.mixer import ChunkRouter, HeadShard, OryxMixer


@dataclass(frozen=True)
class Rule:
    """One megatron parameter (``{i}``: the layer number) and the Hugging Face parameter(s) it becomes."""

    megatron: str
    hf: Tuple[str, ...]
    split: Optional[Callable[[Tensor, object], Tuple[Tensor, ...]]] = None  # fused -> parts (several hf names)
    join: Optional[Callable[[Tuple[Tensor, ...], object], Tensor]] = None

    def pattern(self, template: str) -> re.Pattern:
        return re.compile("^" + re.escape(template).replace(re.escape("{i}"), r"(?P<i>\d+)") + "$")


def _halves(weight: Tensor, config) -> Tuple[Tensor, Tensor]:
    """megatron's SwiGLU fc1 [2F, D] -> gate [F, D] (its first half, silu'd), up [F, D]."""
    gate, up = weight.chunk(2, dim=0)
    return gate.contiguous(), up.contiguous()


def _cat(parts: Tuple[Tensor, ...], config) -> Tensor:
    return torch.cat(parts, dim=0)


def _qkv_sizes(config) -> Tuple[int, int, int]:
    """(query groups, query heads per group, head dim) of a LlamaConfig."""
    groups = config.num_key_value_heads
    return groups, config.num_attention_heads // groups, config.head_dim


def _split_qkv(weight: Tensor, config) -> Tuple[Tensor, Tensor, Tensor]:
    """megatron's linear_qkv [groups * (per_group + 2) * d, D], per query group [its queries, key, value]
    -> q_proj [heads * d, D], k_proj, v_proj [groups * d, D]."""
    groups, per_group, d = _qkv_sizes(config)
    q, k, v = weight.view(groups, (per_group + 2) * d, -1).split([per_group * d, d, d], dim=1)
    return tuple(t.reshape(-1, weight.shape[-1]).contiguous() for t in (q, k, v))


def _join_qkv(parts: Tuple[Tensor, ...], config) -> Tensor:
    groups, per_group, d = _qkv_sizes(config)
    q, k, v = (t.view(groups, -1, t.shape[-1]) for t in parts)
    return torch.cat([q, k, v], dim=1).reshape(-1, q.shape[-1])


_EMBEDDING = Rule("embedding.word_embeddings.weight", ("model.embed_tokens.weight",))
_FINAL_NORM = Rule("decoder.final_layernorm.weight", ("model.norm.weight",))
_OUTPUT = Rule("output_layer.weight", ("lm_head.weight",))  # untied output layers only
_MLP = (
    Rule("decoder.layers.{i}.mlp.linear_fc1.weight",
         ("model.layers.{i}.mlp.gate_proj.weight", "model.layers.{i}.mlp.up_proj.weight"), _halves, _cat),
    Rule("decoder.layers.{i}.mlp.linear_fc2.weight", ("model.layers.{i}.mlp.down_proj.weight",)),
)

def _names(module: torch.nn.Module) -> List[str]:
    return [name for name, _ in module.named_parameters()] + [name for name, _ in module.named_buffers()]


def oryx_rules(config) -> Tuple[Rule, ...]:
    """The rules of an ``OryxHFConfig``'s model: the mixers' and the router's parameters keep their names (every
    kind of layer's of a layer pattern; built on the meta device to list them)."""
    mixer_config = config.mixer_config
    with torch.device("meta"):
        kinds = {layer.mixers: layer for layer in map(mixer_config.layer_config, range(config.num_hidden_layers))}
        names = dict.fromkeys(name for layer in kinds.values()
                              for name in _names(OryxMixer(layer, HeadShard(initialize=False))))
        router = ChunkRouter(mixer_config, config.router_config) if config.router_hidden is not None else None
    return (
        _EMBEDDING,
        Rule("decoder.layers.{i}.input_layernorm.weight", ("model.layers.{i}.input_layernorm.weight",)),
        *(Rule(f"decoder.layers.{{i}}.mixer.{name}", (f"model.layers.{{i}}.mixer.{name}",)) for name in names),
        Rule("decoder.layers.{i}.pre_mlp_layernorm.weight", ("model.layers.{i}.pre_mlp_layernorm.weight",)),
        *_MLP,
        _FINAL_NORM,
        _OUTPUT,
        *(Rule(f"router.{name}", (f"model.router.{name}",)) for name in ([] if router is None else _names(router))),
    )


LLAMA_RULES = (
    _EMBEDDING,
    Rule("decoder.layers.{i}.input_layernorm.weight", ("model.layers.{i}.input_layernorm.weight",)),
    Rule("decoder.layers.{i}.self_attention.linear_qkv.weight",
         tuple(f"model.layers.{{i}}.self_attn.{p}_proj.weight" for p in "qkv"), _split_qkv, _join_qkv),
    Rule("decoder.layers.{i}.self_attention.linear_proj.weight", ("model.layers.{i}.self_attn.o_proj.weight",)),
    Rule("decoder.layers.{i}.pre_mlp_layernorm.weight", ("model.layers.{i}.post_attention_layernorm.weight",)),
    *_MLP,
    _FINAL_NORM,
    _OUTPUT,
)


class LayoutError(ValueError):
    """A parameter that the layout has no rule for, or a missing part of one (its name in the message)."""


def _match(rules, name: str, side: str) -> Tuple[Rule, Optional[str]]:
    for rule in rules:
        templates = (rule.megatron,) if side == "megatron" else rule.hf
        for template in templates:
            found = rule.pattern(template).match(name)
            if found:
                return rule, found.groupdict().get("i")
    raise LayoutError(f"{side} parameter {name!r} has no counterpart in the weight layout (oryx_megatron/hf/layout.py)")


def _fill(template: str, layer: Optional[str]) -> str:
    return template if layer is None else template.replace("{i}", layer)


def to_hf(state: Mapping[str, Tensor], rules, config) -> Dict[str, Tensor]:
    """A megatron state dict (TP = PP = 1; megatron's ``_extra_state`` entries are skipped) in Hugging
    Face names, fused tensors split (``config``: the Hugging Face config)."""
    out = {}
    for name, tensor in state.items():
        if name.endswith("_extra_state"):
            continue
        rule, layer = _match(rules, name, "megatron")
        parts = rule.split(tensor, config) if rule.split else (tensor,)
        out.update({_fill(template, layer): part for template, part in zip(rule.hf, parts)})
    return out


def to_megatron(state: Mapping[str, Tensor], rules, config) -> Dict[str, Tensor]:
    """Hugging Face weights in megatron names, split tensors joined; a missing part is a LayoutError."""
    grouped: Dict[str, Tuple[Rule, Optional[str]]] = {}
    for name in state:
        rule, layer = _match(rules, name, "hf")
        grouped[_fill(rule.megatron, layer)] = (rule, layer)
    out = {}
    for name, (rule, layer) in grouped.items():
        names = [_fill(template, layer) for template in rule.hf]
        missing = [n for n in names if n not in state]
        if missing:
            raise LayoutError(f"hf parameter {missing[0]!r} is missing (a part of megatron's {name!r})")
        parts = tuple(state[n] for n in names)
        out[name] = rule.join(parts, config) if rule.join else parts[0]
    return out
