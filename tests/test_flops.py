"""The one FLOP model (oryx_megatron/models/flops.py) against hand counts, and the training log's MFU
counting with it (the training-step benchmark's rows do too: tests/test_bench_train_step.py)."""

import pytest
import torch

from oryx_megatron.models import flops
from oryx_megatron.models.builder import build_model, transformer_config
from tests.helpers import PATTERN, tiny_args

SEQ, SEQUENCES = 48, 3


@pytest.fixture(scope="module")
def tiny(single_process_parallel):
    """family -> (config, model): hidden 64, 4 heads x 16, MLP 128, vocab 97 (padded to 128), 2 layers."""
    built = {}
    for family in ("transformer", "oryx_tg", "mamba2"):
        args = tiny_args(family)
        config = transformer_config(args, params_dtype=torch.float32)
        built[family] = config, build_model(args, config)
    return built


def test_a_tiny_transformer_step_counted_by_hand(tiny):
    config, model = tiny["transformer"]
    qkv, proj, fc1, fc2 = 64 * 3 * 64, 64 * 64, 64 * 2 * 128, 128 * 64  # SwiGLU: fc1 is two projections
    assert flops.matmul_params(model) == 2 * (qkv + proj + fc1 + fc2) + 128 * 64 == 90_112  # + the tied output
    shape = flops.step_shape(config, 90_112, SEQ, SEQUENCES, read_fraction=0.25)  # no linear mixer: f = 1
    matmul = 6 * 90_112 * 48 * 3  # 6 x P x s x n
    attention = 3 * 48**2 * 4 * (16 + 16) * 2 * 3  # 3 x s^2 x h x (d_k + d_v) x L x n
    assert (matmul, attention) == (77_856_768, 5_308_416)
    assert (shape.attention_fraction, shape.scan_layers) == (1.0, 0)
    assert flops.train_step_flops(shape) == matmul + attention


def test_an_oryx_model_counts_the_attention_it_reads_and_the_scan_of_every_token(tiny):
    config, model = tiny["oryx_tg"]
    params = flops.matmul_params(model)
    scan = 12 * 48 * 4 * 16 * 16 * 2 * 3  # 12 x s x h x d_k x d_v x L x n
    full_attention = 5_308_416
    for read, attention in ((1.0, full_attention), (0.25, full_attention // 4), (0.0, 0)):
        shape = flops.step_shape(config, params, SEQ, SEQUENCES, read_fraction=read)
        assert flops.train_step_flops(shape) == 6 * params * 48 * 3 + attention + scan == (
            flops.matmul_flops(shape) + flops.attention_flops(shape) + 3_538_944)
    mamba_config, mamba = tiny["mamba2"]  # no attention at all, whatever the modes say
    shape = flops.step_shape(mamba_config, flops.matmul_params(mamba), SEQ, SEQUENCES, read_fraction=1.0)
    assert flops.attention_flops(shape) == 0 and flops.scan_flops(shape) == scan


def test_a_layer_pattern_counts_each_layer_as_its_mixers_do(single_process_parallel):
    """O*MG at a read fraction of 0.25: attention in the Oryx block (a quarter) and the attention layer (all of
    it), scans in the Oryx block and the Mamba-2 and GDN layers."""
    config = transformer_config(tiny_args(PATTERN), params_dtype=torch.float32)
    shape = flops.step_shape(config, 1000, SEQ, SEQUENCES, read_fraction=0.25)
    assert (shape.attention_layers, shape.scan_layers, shape.attention_fraction) == (1.25, 3, 1.25 / 4)
    per_layer_attention, per_layer_scan = 3 * 48**2 * 4 * (16 + 16) * 3, 12 * 48 * 4 * 16 * 16 * 3
    assert flops.train_step_flops(shape) == 6 * 1000 * 48 * 3 + 1.25 * per_layer_attention + 3 * per_layer_scan


def test_matmul_params_see_through_megatrons_wrappers(tiny):
    config, model = tiny["transformer"]

    class Wrapper(torch.nn.Module):  # megatron's DDP and Float16Module hold the model as .module
        def __init__(self, module):
            super().__init__()
            self.module = module

    assert flops.matmul_params(Wrapper(Wrapper(model))) == 90_112


def test_the_training_log_counts_with_the_flop_model(corpus, tmp_path, single_process_parallel):
    """perf/tflops x step time of every logged step = train_step_flops at that step's attention fraction."""
    from oryx_megatron.training.loop import pretrain
    from tests.test_train import losses, run_config

    run = run_config(corpus, tmp_path, "train.train_iters=4")
    assert pretrain(run, str(tmp_path / "out")) == 0
    args = tiny_args("oryx_tg", vocab_size=257, max_sequence_length=64, linear_chunk_size=16)
    config = transformer_config(args, params_dtype=torch.float32)
    params = flops.matmul_params(build_model(args, config))
    tokens = run.train.global_batch_size * run.data.seq_length
    logged = [tflops * 1e12 * tokens / tokens_per_s for tflops, tokens_per_s in
              zip(losses(tmp_path / "out", "perf/tflops"), losses(tmp_path / "out", "perf/tokens_per_s"))]
    fractions = losses(tmp_path / "out", "train/attention_fraction")
    expected = [flops.train_step_flops(flops.step_shape(config, params, run.data.seq_length,
                                                        run.train.global_batch_size, f)) for f in fractions]
    assert len(logged) == 4 and len(set(fractions)) > 1  # the modes differ from step to step
    assert logged == pytest.approx(expected, rel=1e-9)
