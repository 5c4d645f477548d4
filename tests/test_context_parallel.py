"""Context parallelism is exact: CP=2 (head all-to-all, megatron's load-balanced split of every sequence) equals
CP=1 on the same weights, for the layer and the whole model, outputs, input gradients and every parameter
gradient (summed over the context-parallel ranks, as megatron's DDP reduces them), every family, with chunked
random modes (the block-sparse attention), packed documents; TP=2 x CP=2 (4 gloo processes) equals TP=1.
fp64 but for the model's loss (megatron's vocab-parallel cross entropy computes in fp32)."""

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from megatron.core import parallel_state

from oryx_megatron.compat.cpu import cuda_to_cpu
from oryx_megatron.mixer import MixerContext
from oryx_megatron.models.builder import build_model, transformer_config
from oryx_megatron.parallel import initialize_parallel
from tests.distributed import run_distributed
from tests.helpers import build_mixer, tiny_args
from tests.test_tensor_parallel import load, save

B, S, HIDDEN, VOCAB = 2, 32, 64, 97  # S divides by 2 x CP for CP = 2 (and 4)
FAMILIES = ["oryx_tg", "oryx_tm", "gdn", "mamba2", "transformer"]
TOLERANCE = {"mixer": 1e-10, "model": 1e-5}


def this_rank_tokens(t: torch.Tensor, dim: int) -> torch.Tensor:
    """This context-parallel rank's tokens of whole sequences: chunks r and 2 cp - 1 - r of 2 cp along ``dim``."""
    cp, r = parallel_state.get_context_parallel_world_size(), parallel_state.get_context_parallel_rank()
    chunks = t.chunk(2 * cp, dim=dim)
    return torch.cat([chunks[r], chunks[2 * cp - 1 - r]], dim=dim)


def inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    x, dy = (torch.randn(S, B, HIDDEN, generator=g, dtype=torch.float64) for _ in range(2))
    modes = torch.randint(0, 2, (B, S // 4), generator=g, dtype=torch.int8).repeat_interleave(4, 1)
    ids = torch.randint(0, VOCAB, (B, S + 1), generator=g)
    documents = torch.tensor([[0] * 5 + [1] * 14 + [2] * 13, [0] * S])  # boundaries inside rank 0's and rank 1's
    return x, dy, modes, ids, documents


def mixer_step(module):
    """(output, input gradient) of this rank's tokens, the parameter gradients summed over the CP ranks."""
    x, dy, modes, _, documents = inputs()
    x = this_rank_tokens(x, 0).clone().requires_grad_()
    out, _ = module(x, MixerContext.build(module.config, modes, documents))
    (out * this_rank_tokens(dy, 0)).sum().backward()
    return out.detach(), x.grad


def model_step(module):
    _, _, modes, ids, documents = inputs()
    with cuda_to_cpu():  # megatron's context-parallel rotary places its indices on the GPU
        loss = module(this_rank_tokens(ids[:, :-1], 1), modes, labels=this_rank_tokens(ids[:, 1:], 1),
                      document_ids=documents)
    (loss * this_rank_tokens(torch.linspace(0.5, 1.5, S, dtype=loss.dtype)[None], 1)).sum().backward()
    return loss.detach(), None


def build(level, family, **parallel):
    if level == "mixer":
        return build_mixer(family, seed=0, parallel=parallel)
    args = tiny_args(family)
    torch.manual_seed(0)
    return build_model(args, transformer_config(args, params_dtype=torch.float64, **parallel))


def ref_layout(ref, level):
    return (ref if level == "mixer" else ref.decoder.layers[0].mixer).layout


def summed_grads(module):
    """Every parameter's gradient summed over the context-parallel ranks (and, for the norms of sequence
    parallelism, over the tensor-parallel ranks), as megatron's DDP and finalize_model_grads sum them."""
    grads = {}
    for name, p in module.named_parameters():
        if p.grad is None:  # not on this loss's path (the layers after the router's first)
            continue
        g = p.grad.clone()
        dist.all_reduce(g, group=parallel_state.get_context_parallel_group())
        if getattr(p, "sequence_parallel", False):
            dist.all_reduce(g, group=parallel_state.get_tensor_model_parallel_group())
        grads[name] = g
    return grads


def cp_equals_cp1(tmp: str, level: str, families=FAMILIES, tp: int = 1, cp: int = 2, sp: bool = False):
    """CP=cp (x TP=tp) equals one rank: the weights travel from one rank through a distributed checkpoint, the
    CP-summed gradients back the same way (saved at TP=tp in place of the weights, loaded at TP=1)."""
    step = mixer_step if level == "mixer" else model_step
    for family in families if level == "model" else [f for f in families if f != "transformer"]:
        case = Path(tmp) / family
        initialize_parallel(tensor_model_parallel_size=1)
        ref = build(level, family)
        out_ref, dx_ref = step(ref)
        grads_ref = {n: p.grad for n, p in ref.named_parameters()}
        save(ref, case / "weights")

        initialize_parallel(tensor_model_parallel_size=tp, context_parallel_size=cp)
        split = build(level, family, tensor_model_parallel_size=tp, context_parallel_size=cp, sequence_parallel=sp)
        load(split, case / "weights")
        if family != "transformer":
            mixer = split if level == "mixer" else split.decoder.layers[0].mixer
            assert mixer.shard.cp.size == cp and mixer.layout == ref_layout(ref, level)
        out, dx = step(split)
        dim = 0 if level == "mixer" else 1
        assert (out - this_rank_tokens(out_ref, dim)).abs().max() < TOLERANCE[level], f"{family} output"
        if dx is not None:
            assert (dx - this_rank_tokens(dx_ref, 0)).abs().max() < TOLERANCE[level], f"{family} input grad"
        with torch.no_grad():
            for name, grad in summed_grads(split).items():
                dict(split.named_parameters())[name].copy_(grad)
        save(split, case / "grads")

        initialize_parallel(tensor_model_parallel_size=1)
        back = build(level, family)
        load(back, case / "grads")
        for name, p in back.named_parameters():
            assert (p - grads_ref[name]).abs().max() < TOLERANCE[level], f"{family} grad of {name}"


@pytest.mark.parametrize("level", ["mixer", "model"])
def test_context_parallel_equals_one_rank(tmp_path, level):
    run_distributed(cp_equals_cp1, str(tmp_path), level)


@pytest.mark.parametrize("level,sp", [("mixer", False), ("model", True)])
def test_tensor_and_context_parallel_equal_one_rank(tmp_path, level, sp):
    """TP=2 x CP=2 (the model with sequence parallelism): 4 processes, one head per rank of the tiny models."""
    run_distributed(cp_equals_cp1, str(tmp_path), level, ["oryx_tg", "oryx_tm", "transformer"], 2, 2, sp,
                    world_size=4)


def router_cp_equals_cp1():
    """The router's logits at CP=2 (readouts of this rank's heads over the whole sequence, gathered) equal one
    rank's; a loss split over the ranks gives, summed, one rank's parameter gradients."""
    _, _, _, ids, documents = inputs()
    results = []
    for cp in (1, 2):
        initialize_parallel(tensor_model_parallel_size=1, context_parallel_size=cp)
        args = tiny_args("oryx_tg", router_hidden=8)
        torch.manual_seed(0)
        model = build_model(args, transformer_config(args, params_dtype=torch.float64, context_parallel_size=cp))
        with torch.no_grad():
            model.router.fc2.weight.normal_()  # nonzero logits (the router starts at p = 0.5)
        logits = model.route(this_rank_tokens(ids[:, :-1], 1), 4, documents)  # [b, S / 4], every chunk's
        share = torch.arange(logits.shape[1]) % cp == parallel_state.get_context_parallel_rank()  # a rank's chunks
        (logits * torch.linspace(-1, 1, logits.numel()).view_as(logits) * share).sum().backward()
        results.append((logits.detach(), summed_grads(model)))
    (ref, ref_grads), (got, grads) = results
    assert (got - ref).abs().max() < 1e-10
    assert grads.keys() == ref_grads.keys() and any("router" in n for n in grads) and any("mixer" in n for n in grads)
    for name, grad in grads.items():
        assert (grad - ref_grads[name]).abs().max() < 1e-10, name


def test_the_router_at_context_parallel_equals_one_rank():
    run_distributed(router_cp_equals_cp1)
