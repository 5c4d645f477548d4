"""A linear mixer from outside the package, with a kernel op of its own (docs/model.md, "Adding a linear mixer"):
tests/mixers/gla.py declares Gated Linear Attention (a decay per key dimension) and its ops, and registers both.
The proofs of every registered mixer run for it by themselves (tests/helpers.py ``linear_families``: the
invariants of tests/test_multi_mixer.py, packed documents, TP=2, CP=2, the Hugging Face model's logits); this
module proves what those do not: its op against the recurrence (fp64, gradients, packed documents), that a recipe
names it, and that a model of it travels through a checkpoint and a saved Hugging Face folder."""

import pytest
import torch
import torch.nn.functional as F

from oryx_megatron.models.builder import build_model, transformer_config
from oryx_megatron.ops import OPS, get_kernels
from tests.helpers import tiny_args
from tests.mixers.gla import GatedLinearAttention, chunk_gla, gla_step
from tests.ops.equivalence import assert_same_values_and_grads
from tests.ops.test_ops_documents import CHUNK, DK, DV, H, S, compare
from tests.ops.test_ops_documents import rand as document_rand
from tests.test_multi_mixer import random_modes

MIXERS = "attention+gla"
B = 2


def gla_inputs(s, seed=0):
    """q, k [B, s, H, DK], v [B, s, H, DV], log decays g [B, s, H, DK] (<= 0), an initial state [B, H, DK, DV]."""
    gen = torch.Generator().manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=gen, dtype=torch.float64)  # noqa: E731
    inputs = dict(q=rand(B, s, H, DK), k=rand(B, s, H, DK), v=rand(B, s, H, DV), g=F.logsigmoid(rand(B, s, H, DK)))
    return inputs, rand(B, H, DK, DV)


def loop_steps(q, k, v, g, initial_state):
    state, outs = initial_state, []
    for t in range(q.shape[1]):
        o, state = gla_step(q[:, t], k[:, t], v[:, t], g[:, t], state)
        outs.append(o)
    return torch.stack(outs, dim=1), state


@pytest.mark.parametrize("s,chunk_size", [(21, 8), (16, 8), (3, 8)])
def test_its_chunked_op_equals_the_recurrence_fp64_with_grads(s, chunk_size):
    """chunk_gla == a loop of gla_step (S_t = diag(alpha_t) S_{t-1} + k_t v_t^T), outputs, final state and the
    gradients w.r.t. every input: a partial last chunk, whole chunks, a sequence shorter than one."""
    inputs, h0 = gla_inputs(s)
    leaves = {name: t.clone().requires_grad_() for name, t in {**inputs, "initial_state": h0}.items()}
    o, state = chunk_gla(**leaves, chunk_size=chunk_size)
    grads = assert_same_values_and_grads((o, state), loop_steps(**leaves), leaves)
    assert all(grads[name].abs().max() > 0 for name in leaves)


@pytest.mark.parametrize("initial", [False, True])
def test_its_op_on_packed_documents_equals_each_document_alone(initial):
    """Its per-dimension decays reset at document starts (ops.chunking.reset_at_document_starts): outputs,
    final states and gradients as for each document alone (tests/ops/test_ops_documents.py's fixture)."""
    q, k, v = (document_rand(3, S, H, d, seed=i) for i, d in ((1, DK), (2, DK), (3, DV)))
    g = F.logsigmoid(document_rand(3, S, H, DK, seed=4) + 2)  # ~-0.13: the state outlives a chunk
    state = ("initial_state", document_rand(3, H, DK, DV, seed=5)) if initial else None
    compare(chunk_gla, [q, k, v, g], [], dict(chunk_size=CHUNK), first_state=state)


def test_a_recipe_names_the_new_mixer_and_its_ops_are_served():
    args = tiny_args(MIXERS)
    assert args.family == "oryx" and args.linear_mixer == "gla" and transformer_config(args).mixers == MIXERS
    with pytest.raises(ValueError, match=r"model.mixers='attention\+gla': family 'oryx_tg' has the mixers"):
        tiny_args("oryx_tg", mixers=MIXERS)
    kernels = get_kernels("torch")
    assert kernels.chunk_gla is OPS["chunk_gla"].torch is chunk_gla and kernels.names["gla_step"] == "torch"


def test_checkpoint_and_hf_model_give_the_same_logits_and_a_folder_is_refused(single_process_parallel, tmp_path):
    """The model-only checkpoint of a run loads it by its recipe's mixers; the Hugging Face model converted from it
    (in this process, where the mixer is registered) gives the same logits; saving it as a folder is refused by
    name, since the folder could not carry the mixer's code (docs/hf.md), and nothing is written."""
    from oryx_megatron.inference.checkpoint import load_model
    from oryx_megatron.interop.hf_convert import hf_config, hf_model, megatron_to_hf, model_args
    from oryx_megatron.run_config import TrainConfig
    from oryx_megatron.training.router import save_model

    args = tiny_args(MIXERS)
    torch.manual_seed(0)
    model = build_model(args, transformer_config(args)).eval()
    assert isinstance(model.decoder.layers[0].mixer.linear_mixer, GatedLinearAttention)
    g = torch.Generator().manual_seed(42)
    ids, modes = torch.randint(0, args.vocab_size, (2, 29), generator=g), random_modes(42, chunk=8)
    with torch.no_grad():
        want = model(ids, modes)

    run = TrainConfig(model=args)
    run.checkpoint.dir = str(tmp_path / "ckpt")
    loaded, run = load_model(str(save_model(run, model, iteration=1)))
    assert run.model.mixers == MIXERS
    with torch.no_grad():
        assert torch.equal(loaded(ids, modes), want)

    config = hf_config(args)
    hf = hf_model(config, megatron_to_hf(model.state_dict(), config)).eval()
    assert model_args(hf.config).mixers == MIXERS
    with torch.no_grad():
        assert (hf(ids, modes=modes).logits - want[..., : config.vocab_size]).abs().max() <= 1e-5
    with pytest.raises(ValueError, match=r"OryxHFConfig.mixers='attention\+gla': GatedLinearAttention "
                                         r"\(tests.mixers.gla\) is neither a module of oryx-megatron nor a mixer plugin's"):
        hf.save_pretrained(tmp_path / "hf")
    assert not (tmp_path / "hf").exists() or not any((tmp_path / "hf").iterdir())
