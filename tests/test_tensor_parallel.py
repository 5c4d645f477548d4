"""Tensor parallelism is exact: TP=2 (with and without sequence parallel) equals TP=1 on the
same full weights, for outputs, input gradients and parameter gradients (2 gloo processes, fp64);
the sequence-parallel cases read packed documents (``document_ids``, full sequence on every rank).

The full weights travel through megatron's distributed checkpoint: saved at TP=1, loaded
at TP=2. The TP=2 parameter gradients travel back the same way (saved in place of the
weights, loaded at TP=1), so the test also proves that checkpoints reshard across TP.
"""

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing, parallel_state

from oryx_megatron.mixer import MixerContext
from oryx_megatron.models.builder import build_model, transformer_config
from oryx_megatron.parallel import initialize_parallel
from tests.distributed import run_distributed
from tests.helpers import PATTERN, build_mixer, linear_families, tiny_args

B, S, HIDDEN, VOCAB = 2, 24, 64, 97
SEQUENCE_PARALLEL = (False, True)  # with sequence parallelism: packed documents, a mixer's hidden projections gathered


def save(module, path: Path):
    if dist.get_rank() == 0:
        path.mkdir(parents=True)
    dist.barrier()
    dist_checkpointing.save(module.sharded_state_dict(), str(path))


def load(module, path: Path):
    module.load_state_dict(dist_checkpointing.load(module.sharded_state_dict(), str(path)))


def shard_sequence(t: torch.Tensor, dim: int = 0) -> torch.Tensor:
    tp = parallel_state.get_tensor_model_parallel_world_size()
    return t.chunk(tp, dim=dim)[parallel_state.get_tensor_model_parallel_rank()]


# megatron's vocab-parallel cross entropy computes in fp32, whatever the model dtype;
# everything before the loss is fp64.
TOLERANCE = {"mixer": 1e-10, "model": 1e-5}


def assert_close(actual, expected, what, tol):
    diff = (actual - expected).abs().max().item()
    assert diff < tol, f"{what}: max abs diff {diff:.3e} (tolerance {tol:.0e})"


def inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(S, B, HIDDEN, generator=g, dtype=torch.float64)
    dy = torch.randn(S, B, HIDDEN, generator=g, dtype=torch.float64)
    modes = torch.randint(0, 2, (B, S // 4), generator=g, dtype=torch.int8).repeat_interleave(4, 1)
    ids = torch.randint(0, VOCAB, (B, S + 1), generator=g)
    return x, dy, modes, ids


def documents(sequence_parallel):
    """Packed documents of the sequence-parallel cases: boundaries at 5 and 13 (shards of 12 tokens:
    one inside the first, one inside the second), sample 1 one document."""
    if not sequence_parallel:
        return None
    return torch.tensor([[0] * 5 + [1] * 8 + [2] * 11, [0] * S])


def mixer_step(module, sequence_parallel, document_ids=None):
    """Mixer forward/backward; returns (output, input grad) as this rank holds them."""
    x, dy, modes, _ = inputs()
    if sequence_parallel:
        x, dy = shard_sequence(x), shard_sequence(dy)
    x = x.clone().requires_grad_()
    out, _ = module(x, MixerContext.build(module.config, modes, document_ids))
    out.backward(dy)
    reduce_sequence_parallel_grads(module, sequence_parallel)
    return out.detach(), x.grad


def model_step(module, sequence_parallel, document_ids=None):
    """Model loss forward/backward; returns (per-token loss, nothing)."""
    _, _, modes, ids = inputs()
    loss = module(ids[:, :-1], modes, labels=ids[:, 1:], document_ids=document_ids)
    loss.sum().backward()
    reduce_sequence_parallel_grads(module, sequence_parallel)
    return loss.detach(), None


def reduce_sequence_parallel_grads(module, sequence_parallel):
    """What megatron's finalize_model_grads does under sequence parallelism for weights replicated over TP (the
    norms, a linear mixer's cross-head projection): each rank's gradient is of its tokens, summed over TP."""
    if not sequence_parallel:
        return
    for p in module.parameters():
        if getattr(p, "sequence_parallel", False):
            dist.all_reduce(p.grad, group=parallel_state.get_tensor_model_parallel_group())


def build(level, family, seed, recipe, **parallel):
    if level == "mixer":
        return build_mixer(family, seed=seed, parallel=parallel, **recipe)
    args = tiny_args(family, **recipe)
    torch.manual_seed(seed)
    return build_model(args, transformer_config(args, params_dtype=torch.float64, **parallel))


def tp_equals_tp1(tmp: str, level: str, cases, **recipe):
    """Each (family, sequence_parallel) of ``cases`` (recipe fields ``recipe``): TP=2 equals TP=1 (2 processes)."""
    step = mixer_step if level == "mixer" else model_step
    for family, sp in cases:
        case = Path(tmp) / f"{family}-sp{int(sp)}"
        initialize_parallel(tensor_model_parallel_size=1)
        ref = build(level, family, 0, recipe)
        out_ref, dx_ref = step(ref, sequence_parallel=False, document_ids=documents(sp))
        grads_ref = {n: p.grad.clone() for n, p in ref.named_parameters()}
        save(ref, case / "weights")

        initialize_parallel(tensor_model_parallel_size=2)
        tp2 = build(level, family, 1, recipe, tensor_model_parallel_size=2, sequence_parallel=sp)
        load(tp2, case / "weights")
        out, dx = step(tp2, sequence_parallel=sp, document_ids=documents(sp))
        shard = shard_sequence if (sp and level == "mixer") else (lambda t: t)
        assert_close(out, shard(out_ref), f"{level} {family} sp={sp}: output", TOLERANCE[level])
        if dx is not None:
            assert_close(dx, shard(dx_ref), f"{level} {family} sp={sp}: input grad", TOLERANCE[level])
        with torch.no_grad():
            for p in tp2.parameters():
                p.copy_(p.grad)
        save(tp2, case / "grads")

        initialize_parallel(tensor_model_parallel_size=1)
        back = build(level, family, 2, recipe)
        load(back, case / "grads")
        for name, p in back.named_parameters():
            assert_close(p, grads_ref[name], f"{level} {family} sp={sp}: grad of {name}", TOLERANCE[level])


@pytest.mark.parametrize("family", linear_families())
@pytest.mark.parametrize("level", ["mixer", "model"])
def test_tensor_parallel_equals_single_rank(tmp_path, level, family):
    """Attention with each registered linear mixer (its name in the test's id: ``-k lanorm``), with and without
    sequence parallelism."""
    run_distributed(tp_equals_tp1, str(tmp_path), level, [(family, sp) for sp in SEQUENCE_PARALLEL])


def test_a_layer_pattern_at_tensor_parallel_equals_single_rank(tmp_path):
    """A model of every kind of layer (``PATTERN``) with sequence parallelism and packed documents."""
    run_distributed(tp_equals_tp1, str(tmp_path), "model", [(PATTERN, True)])
