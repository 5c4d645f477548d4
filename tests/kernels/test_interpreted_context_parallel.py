"""Context parallelism on the CUDA path: the mixer core at CP=2 (2 gloo processes, the head all-to-all before the
short convs and both mixers) computing with fla's and mamba-ssm's real Triton kernels (Triton's interpreter,
``ops.cuda``'s wrappers) equals the same mixer at CP=1, outputs and every parameter gradient (summed over the
ranks), packed documents (fla's cu_seqlens, mamba-ssm's seq_idx) included. Run by ``make test-kernels``."""

import os
import socket

import pytest

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("Triton interpreter tests: run `make test-kernels` (TRITON_INTERPRET=1 before triton is imported)",
                allow_module_level=True)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from oryx_megatron import ops  # noqa: E402
from oryx_megatron.config import MixerConfig  # noqa: E402
from oryx_megatron.mixer import ContextParallel, HeadShard, MixerContext, OryxMixer  # noqa: E402
from oryx_megatron.ops import cuda  # noqa: E402
from tests.kernels import triton_cpu  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:Triton is not supported on current platform:UserWarning")

B, S, HIDDEN = 1, 64, 32  # 64 tokens: 2 x CP = 4 chunks of 16; the kernels' chunk is 64
KERNEL_OPS = ("chunk_gated_delta_rule", "ssd_chunk_scan", "gated_rms_norm")  # the interpreted ones a forward runs


def with_cuda_kernels(mixer: OryxMixer) -> OryxMixer:
    """The mixer computing with ``ops.cuda``'s wrappers of the Triton kernels (the torch ops elsewhere)."""
    kernels = ops.Kernels({name: op.cuda if name in KERNEL_OPS else op.torch for name, op in ops.OPS.items()}, {})
    for module in mixer.modules():
        if getattr(module, "kernels", None) is not None:
            module.kernels = kernels
    return mixer


def this_rank_tokens(t: torch.Tensor, cp: ContextParallel) -> torch.Tensor:
    chunks = t.chunk(2 * cp.size, dim=1)
    return torch.cat([chunks[cp.rank], chunks[2 * cp.size - 1 - cp.rank]], dim=1) if cp.size > 1 else t


def forward_backward(mixer: OryxMixer, cp: ContextParallel):
    g = torch.Generator().manual_seed(0)
    x, dy = (torch.randn(B, S, HIDDEN, generator=g) for _ in range(2))
    modes = torch.randint(0, 2, (B, S // 8), generator=g, dtype=torch.int8).repeat_interleave(8, 1)
    documents = torch.tensor([[0] * 20 + [1] * 44])  # a boundary inside rank 0's first chunk's neighbour
    out = mixer(this_rank_tokens(x, cp), MixerContext.build(mixer.config, modes, documents))
    (out * this_rank_tokens(dy, cp)).sum().backward()
    return out.detach()


def _rank(rank: int, port: int, mixers: str, results: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        with pytest.MonkeyPatch.context() as patch:
            triton_cpu.install(patch)
            patch.setattr(cuda, "_kernel_takes", lambda x, dtypes=None: True)  # CPU tensors to the kernels
            config = MixerConfig(hidden_size=HIDDEN, num_attention_heads=2, kv_channels=16, mixers=mixers,
                                 kernel_backend="torch")
            outputs, cp2 = [], ContextParallel(dist.group.WORLD)
            for cp in (ContextParallel(), cp2):
                torch.manual_seed(1)
                mixer = with_cuda_kernels(OryxMixer(config, HeadShard(cp=cp)))
                outputs.append((forward_backward(mixer, cp), {n: p.grad for n, p in mixer.named_parameters()}))
            (ref, ref_grads), (got, grads) = outputs
            ref = this_rank_tokens(ref, cp2)  # the reference's outputs at this rank's tokens
            for grad in grads.values():
                dist.all_reduce(grad)
            results[rank] = (float((got - ref).abs().max()),
                             max(float((grads[n] - ref_grads[n]).abs().max() / ref_grads[n].abs().max().clamp_min(1e-6))
                                 for n in grads))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("mixers", ["attention+gdn", "attention+mamba2"])
def test_context_parallel_with_the_triton_kernels_equals_one_rank(mixers):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    results = mp.Manager().dict()
    mp.spawn(_rank, args=(port, mixers, results), nprocs=2, join=True)
    for rank, (out_err, grad_err) in results.items():
        assert out_err < 1e-5 and grad_err < 1e-4, (rank, out_err, grad_err)
