"""Section a of the GPU check: every CUDA kernel of ``oryx_megatron.ops.cuda`` against the torch op in
fp64 on the same bf16 inputs (outputs, states and, for the sequence ops, gradients), through the
runtime probe's comparison (``ops.probe.KernelCall``) at the check's sizes and cases."""

import zlib
from typing import List, Optional, Tuple

import torch

from oryx_megatron import ops
from oryx_megatron.checks.gpu_check.report import Report, measured
from oryx_megatron.checks.gpu_check.setup import KERNEL_RTOL, Setup
from oryx_megatron.ops import cuda, selection
from oryx_megatron.ops import probe as probing

DIRECTIONS = ("fwd", "bwd")


def kernel_cases() -> List[Tuple[str, str]]:
    """(op, state case) for every call checked."""
    cases = []
    for op in ops.cuda_ops():
        if op == "causal_attention":
            cases.append((op, "causal"))
        elif op == "block_sparse_causal_attention":
            cases.append((op, f"every other block of {cuda.FLEX_BLOCK_SIZE} reads"))
        elif op == "gated_rms_norm":
            cases.append((op, "per head"))
        elif ops.OPS[op].backward:
            cases += [(op, "no initial state"), (op, "initial state")]
        else:
            cases.append((op, "step"))
    return cases


def kernel_rows() -> int:
    """Rows of the section when nothing goes wrong."""
    return sum(2 if ops.OPS[op].backward else 1 for op, _ in kernel_cases())


def kernel_call(op: str, case: str, setup: Setup) -> probing.KernelCall:
    """The CUDA wrapper of ``op`` against the torch op on the case's inputs (seeded by op and case)."""
    gen = torch.Generator().manual_seed(zlib.crc32(f"{op}/{case}".encode()))
    values = probing.kernel_inputs(op, setup.sizes.kernel_shape, case == "initial state", gen)
    return probing.KernelCall(op, values, setup.device, ops.OPS[op].cuda, ops.OPS[op].torch)


def why_not(op: str, direction: str, setup: Setup, env: selection.KernelEnvironment) -> Optional[str]:
    """Why the kernel is not measured in this direction: the verdict this GPU session's probe recorded
    (a crash, a timeout, a refusal: $ORYX_KERNEL_PROBES), else, on a GPU, a known condition."""
    recorded = probing.recorded_verdicts().get(op)
    backward = direction == "bwd"
    if recorded is not None and recorded["backward" if backward else "forward"]:
        return f"its session probe: {recorded['backward' if backward else 'forward']}"
    return None if setup.dry_run else selection.refusal(op, env, backward=backward)


def check_kernels(setup: Setup, report: Report) -> None:
    env, auto = selection.KernelEnvironment.detect(), ops.get_kernels("auto").names
    for op, case in kernel_cases():
        call = kernel_call(op, case, setup)
        measures = {"fwd": call.forward_errors, "bwd": call.backward_errors}
        kernel = "torch" if setup.dry_run else ops.OPS[op].implementation
        base = {"op": op, "implementation": kernel, "note": _kernel_note(kernel, auto[op], setup)}
        for direction in DIRECTIONS[:2 if ops.OPS[op].backward else 1]:
            row = {**base, "case": f"{direction}, {case}"}
            reason = why_not(op, direction, setup, env)
            if reason:
                report.add({**row, "status": "skipped", "note": f"skipped: {reason}"})
            else:
                report.add(measured(row, measures[direction], KERNEL_RTOL))


def _kernel_note(kernel: str, auto: str, setup: Setup) -> str:
    if setup.dry_run:
        return "dry run: the CUDA wrapper ran the torch op (CPU tensors) vs the fp64 torch op"
    if auto != kernel:
        return f'get_kernels("auto") picks {auto} instead (its one-time check, or ${ops.BACKEND_ENV_VAR})'
    return ""
