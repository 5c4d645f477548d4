"""The project's own kernel ops, each declared once (``registry.KernelOp``): the torch op, the CUDA kernel of
``ops/cuda.py``, when that kernel may run, and the valid inputs of its one-time check (``ops.probe``)."""

from typing import Optional, Tuple

import torch
import torch.nn.functional as F

from . import attention, conv, cuda, gated_delta_rule, norm, ssd
from .cuda import FLEX_BLOCK_SIZE
from .probe import ACT, GATE
from .registry import KernelOp, Values, register_op
from .selection import KernelEnvironment, KnownIssue, Package, version_tuple

Shape = Tuple[int, int, int, int]  # b, s, h, d
CONV_WIDTH = 4


def _random(gen: torch.Generator):
    def rand(*size):
        return torch.randn(*size, generator=gen, dtype=torch.float64)
    return rand


def _with_state(args: Values, state, with_state: bool, step: bool) -> Values:
    """A step op always takes its ``state``; a sequence op its ``initial_state`` where asked."""
    if with_state or step:
        args["state" if step else "initial_state"] = state
    return args


def _conv_inputs(step: bool):
    def inputs(shape: Shape, with_state: bool, gen: torch.Generator) -> Values:
        b, s, h, d = shape
        rand, c = _random(gen), h * d
        args = {"x": (rand(b, *(() if step else (s,)), c), ACT), "weight": (rand(c, CONV_WIDTH) / 2, ACT),
                "bias": (rand(c), ACT)}  # x [b, (s,) c]
        return _with_state(args, (rand(b, c, CONV_WIDTH - 1), ACT), with_state, step)  # [b, c, w - 1] previous inputs
    return inputs


def _gated_delta_rule_inputs(step: bool):
    def inputs(shape: Shape, with_state: bool, gen: torch.Generator) -> Values:
        b, s, h, d = shape
        rand, seq = _random(gen), () if step else (s,)
        args = {name: (F.normalize(rand(b, *seq, h, d), dim=-1), ACT) for name in ("q", "k")}  # [b, (s,) h, d_k]
        args.update(v=(rand(b, *seq, h, d), ACT),  # [b, (s,) h, d_v]
                    g=(F.logsigmoid(rand(b, *seq, h)), GATE), beta=(rand(b, *seq, h).sigmoid(), GATE))  # [b, (s,) h]
        return _with_state(args, (rand(b, h, d, d), GATE), with_state, step)  # [b, h, d_k, d_v]
    return inputs


def _ssd_inputs(step: bool):
    def inputs(shape: Shape, with_state: bool, gen: torch.Generator) -> Values:
        b, s, h, d = shape
        rand, seq = _random(gen), () if step else (s,)
        args = {"x": (rand(b, *seq, h, d), ACT),  # [b, (s,) h, p]
                "dt": (F.softplus(rand(b, *seq, h) - 2), GATE),  # [b, (s,) h], > 0
                "A": (-(rand(h) / 2).exp(), GATE),  # [h], < 0
                "B": (rand(b, *seq, h, d), ACT), "C": (rand(b, *seq, h, d), ACT),  # [b, (s,) h, n]
                "D": (rand(h), GATE)}  # [h], a parameter the model keeps in fp32
        return _with_state(args, (rand(b, h, d, d) / 4, GATE), with_state, step)  # [b, h, n, p]
    return inputs


def _norm_inputs(shape: Shape, with_state: bool, gen: torch.Generator) -> Values:
    b, s, h, d = shape
    rand = _random(gen)
    return {"y": (rand(b, s, h, d), ACT), "gate": (rand(b, s, h, d), ACT),  # [b, s, h, d_v]
            "weight": (1 + rand(h * d) / 10, ACT)}  # [h * d_v], a parameter of the model


def _attention_inputs(block_sparse: bool):
    """q, k, v [b, s, h, d]; the query blocks of block_sparse_causal_attention (FLEX_BLOCK_SIZE) read
    attention every other block."""
    def inputs(shape: Shape, with_state: bool, gen: torch.Generator) -> Values:
        b, s, h, d = shape
        rand = _random(gen)
        args = {name: (rand(b, s, h, d), ACT) for name in ("q", "k", "v")}
        if block_sparse:
            read = (torch.arange(s) // FLEX_BLOCK_SIZE % 2 == 0).expand(b, s).clone()  # [b, s]
            args.update(reads=attention.BlockReads(read, FLEX_BLOCK_SIZE))
        return args
    return inputs


def _fla_hopper_backward(env: KernelEnvironment) -> Optional[str]:
    """fla issue 640: on Hopper, Triton >= 3.4.0 and < 3.7.1 compiles the gated delta rule backward
    (chunk_bwd_dqkwg) wrongly. fla >= 0.5 then refuses unless tilelang (which needs nvcc) takes it;
    older fla computes wrong gradients without a word."""
    triton = env.version("triton")
    if env.capability is None or env.capability[0] != 9 or triton is None:
        return None
    if not (3, 4, 0) <= version_tuple(triton) < (3, 7, 1):
        return None
    if env.version("tilelang") and env.nvcc:
        return None
    return (f"Triton {triton} on a Hopper GPU (sm{env.capability[0]}{env.capability[1]}) computes fla's gated "
            f"delta rule backward wrongly (fla issue 640): install Triton >= 3.7.1, or tilelang with nvcc on PATH")


def _flex_without_compile(env: KernelEnvironment) -> Optional[str]:
    """Uncompiled, FlexAttention runs its reference: the full score matrix, every block computed."""
    if env.compile:
        return None
    return "torch.compile is disabled (TORCHDYNAMO_DISABLE=1), so FlexAttention would not skip any block: unset it"


CAUSAL_CONV1D = Package("causal-conv1d", "1.4.0")
FLA = Package("fla-core", "0.6.0")
MAMBA_SSM = Package("mamba-ssm", "2.2.0")

BUILTIN = (
    KernelOp("causal_conv1d", conv.causal_conv1d, cuda.causal_conv1d, "causal_conv1d", (CAUSAL_CONV1D,),
             _conv_inputs(step=False), ("y", "final_state"), backward=True),
    KernelOp("causal_conv1d_step", conv.causal_conv1d_step, cuda.causal_conv1d_step, "causal_conv1d",
             (CAUSAL_CONV1D,), _conv_inputs(step=True), ("y", "new_state")),
    # fla's chunk GDN keeps its chunk states in bf16: dg at the last token (the final state's gradient enters
    # there as a sum of 64 x 64 bf16 products) errs by 1.52e-2 under the interpreter; the torch op with dg 2%
    # off errs by 1.99e-2. One tolerance for all would have to lie between 1.52e-2 and the dq mutant's 1.58e-2.
    KernelOp("chunk_gated_delta_rule", gated_delta_rule.chunk_gated_delta_rule, cuda.chunk_gated_delta_rule, "fla",
             (FLA, KnownIssue(_fla_hopper_backward, backward_only=True)), _gated_delta_rule_inputs(step=False),
             ("o", "final_state"), backward=True, tolerance={"dg": 1.8e-2}),
    KernelOp("gated_delta_rule_step", gated_delta_rule.gated_delta_rule_step, cuda.gated_delta_rule_step, "fla",
             (FLA,), _gated_delta_rule_inputs(step=True), ("o", "new_state")),
    KernelOp("ssd_chunk_scan", ssd.ssd_chunk_scan, cuda.ssd_chunk_scan, "mamba_ssm", (MAMBA_SSM,),
             _ssd_inputs(step=False), ("y", "final_state"), backward=True),
    KernelOp("ssd_step", ssd.ssd_step, cuda.ssd_step, "mamba_ssm", (MAMBA_SSM,), _ssd_inputs(step=True),
             ("y", "new_state")),
    KernelOp("causal_attention", attention.causal_attention, cuda.causal_attention, "sdpa", (),
             _attention_inputs(block_sparse=False), ("o",), backward=True),
    KernelOp("block_sparse_causal_attention", attention.block_sparse_causal_attention,
             cuda.block_sparse_causal_attention, "flex_attention", (KnownIssue(_flex_without_compile),),
             _attention_inputs(block_sparse=True), ("o",), backward=True),
    KernelOp("gated_rms_norm", norm.gated_rms_norm, cuda.gated_rms_norm, "mamba_ssm", (MAMBA_SSM,), _norm_inputs,
             ("o",), backward=True),
)
for _op in BUILTIN:
    register_op(_op)
