"""CUDA-graph decode (GPU only; the replay itself is not run here): on CPU the default is the
eager, graph-free step, and asking for graphs is a clear error."""

import pytest
import torch

from oryx_megatron.inference import generate
from oryx_megatron.inference.cuda_graphs import GraphedDecodeStep, decode_step, use_cuda_graphs
from oryx_megatron.models.builder import build_model, transformer_config
from tests.helpers import tiny_args

pytestmark = pytest.mark.usefixtures("single_process_parallel", "one_thread")


@pytest.fixture(scope="module")
def model(single_process_parallel):
    args = tiny_args()
    torch.manual_seed(0)
    return build_model(args, transformer_config(args, params_dtype=torch.float64))


def test_graphs_default_to_on_for_cuda_and_off_elsewhere():
    assert use_cuda_graphs(None, torch.device("cuda")) and use_cuda_graphs(True, torch.device("cuda:0"))
    assert not use_cuda_graphs(None, torch.device("cpu")) and not use_cuda_graphs(False, torch.device("cuda"))


def test_cpu_generation_is_graph_free(model, monkeypatch):
    def capture(*args, **kwargs):
        raise AssertionError("a CUDA graph was captured on CPU")

    monkeypatch.setattr(GraphedDecodeStep, "_capture", capture)
    caches = model.allocate_inference_cache(1, torch.float64)
    assert not isinstance(decode_step(model, caches, use_cuda_graphs(None, torch.device("cpu"))), GraphedDecodeStep)
    assert len(generate(model, [[1, 2, 3]], "all_attention", 4, vocab_size=97).tokens[0]) == 4


def test_cuda_graphs_on_cpu_is_a_clear_error(model):
    with pytest.raises(ValueError, match=r"cuda_graphs=True needs the model on a CUDA device; it is on cpu"):
        generate(model, [[1, 2, 3]], "all_attention", 4, vocab_size=97, cuda_graphs=True)


def test_a_capture_that_raises_falls_back_to_the_eager_step_and_says_why(model, caplog):
    """On a GPU a capture can fail (a kernel that cannot be captured, a machine never tried): the
    generation goes on eagerly, the caches as they were, the error kept. Here the capture fails for
    real: there is no CUDA to capture on."""
    from oryx_megatron.config import Mode
    from oryx_megatron.inference.forward import cached_logits

    prompt = torch.tensor([[1, 2, 3], [4, 5, 6]])
    caches = {name: model.allocate_inference_cache(2, torch.float64) for name in ("graphed", "eager")}
    for cache in caches.values():
        cached_logits(model, prompt, Mode.ATTENTION, cache)
    graphed, eager = GraphedDecodeStep(model, caches["graphed"]), decode_step(model, caches["eager"], False)
    with caplog.at_level("WARNING", logger="oryx_megatron.inference.cuda_graphs"):
        for token in (7, 8, 9):
            ids = torch.full((2, 1), token)
            assert torch.equal(graphed(ids, Mode.ATTENTION), eager(ids, Mode.ATTENTION))
    assert graphed.capture_error is not None and not graphed.graphs
    assert f"CUDA-graph capture failed, decoding eagerly from here on: {graphed.capture_error}" in caplog.text
    assert caplog.text.count("CUDA-graph capture failed") == 1  # tried once, then eager
    assert [c.seqlen for c in caches["graphed"]] == [c.seqlen for c in caches["eager"]] == [6] * len(caches["eager"])
