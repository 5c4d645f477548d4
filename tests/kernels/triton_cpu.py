"""What fla's and mamba-ssm's Triton kernels ask of a GPU, answered on CPU for Triton 3.7.1's
interpreter (TRITON_INTERPRET=1). Test-only: ``install(patch)`` applies each patch through a
``pytest.MonkeyPatch``, which undoes them.

bf16: numpy has no bf16, so the interpreter keeps bf16 values as their raw 16 bits and computes
on the bit patterns; the patches widen bf16 operands to fp32 and round bf16 results to nearest
even, as the GPU's bf16 arithmetic does.
"""

import ast
import contextlib
from types import SimpleNamespace

import numpy as np
import torch
import triton.language as tl
from triton.runtime import autotuner, interpreter
from triton.runtime.interpreter import InterpreterBuilder, ReduceScanOpInterface, TensorHandle

SM_COUNT = 4  # what get_device_properties reports: mamba sizes its work splits by it, nothing else


def _is_bf16(handle) -> bool:
    return isinstance(handle, TensorHandle) and handle.dtype.scalar == tl.bfloat16


def _to_fp32(handle):
    """bf16 -> fp32 exactly (other arguments as they are)."""
    if not _is_bf16(handle):
        return handle
    return TensorHandle((handle.data.astype(np.uint32) << 16).view(np.float32), tl.float32)


def _to_bf16(handle: TensorHandle) -> TensorHandle:
    """fp32 -> bf16, round to nearest even."""
    values = handle.data.astype(np.float32)
    bits = values.view(np.uint32)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return TensorHandle(np.where(np.isnan(values), 0x7FC0, rounded).astype(np.uint16), tl.bfloat16)


def _in_fp32(method, result_like: int):
    """``method`` on fp32 copies of bf16 operands; its float result is rounded to bf16 where the
    operand it takes its type from (argument ``result_like``) was bf16."""

    def run(self, *args):
        out = method(self, *map(_to_fp32, args))
        return _to_bf16(out) if _is_bf16(args[result_like]) and out.data.dtype == np.float32 else out

    return run


def _cast(self, src, dst_type, cast_impl=InterpreterBuilder.cast_impl):
    """Casts from or to bf16 through fp32, rounding to nearest even: the interpreter truncates
    fp32 -> bf16 and reinterprets the raw bits in every other bf16 cast (fp64, integers)."""
    src = _to_fp32(src)
    if dst_type.scalar == tl.bfloat16:
        return _to_bf16(TensorHandle(src.data.astype(np.float32), tl.float32))
    return cast_impl(self, src, dst_type)


def _reduce_or_scan(self, inputs, apply=ReduceScanOpInterface.apply):
    """Reductions and scans (tl.sum, tl.max, tl.cumsum, ...) of bf16 in fp32, each result back
    to bf16 where its input was: the interpreter sums the raw bits (tl.sum does not widen bf16)."""
    if not isinstance(inputs, tuple):
        return _reduce_or_scan(self, (inputs,))[0]
    wide = tuple(tl.core.tensor(_to_fp32(t.handle), t.type.with_element_ty(tl.float32)) if _is_bf16(t.handle) else t
                 for t in inputs)
    outs = apply(self, wide)
    return tuple(tl.core.tensor(_to_bf16(o.handle), o.type.with_element_ty(tl.bfloat16))
                 if _is_bf16(t.handle) and o.handle.data.dtype == np.float32 else o
                 for t, o in zip(inputs, outs))


class _TensorLoopVariables(interpreter.ASTTransformer):
    """``for i in range(n)`` / ``tl.range``: the loop variable is a tensor, as compiled (fla calls
    ``i.to(tl.int64)``); the interpreter's is a Python int. ``tl.static_range`` keeps ints."""

    def visit_For(self, node):
        self.generic_visit(node)
        loops_over_range = isinstance(node.iter, ast.Call) and (
            getattr(node.iter.func, "id", None) == "range" or getattr(node.iter.func, "attr", None) == "range")
        if loops_over_range and isinstance(node.target, ast.Name):  # `i = i` becomes `i = to_tensor(i)`
            name = node.target.id
            same = ast.Assign([ast.Name(name, ast.Store())], ast.Name(name, ast.Load()))
            node.body.insert(0, self.visit_Assign(same))
        return node


def _device(index, device=torch.cuda.device):
    """torch.cuda.device(None), which mamba enters with a CPU tensor's device index, is a no-op
    (torch 2.13 raises TypeError on a machine without CUDA)."""
    return contextlib.nullcontext() if index is None else device(index)


def install(patch) -> None:
    """Apply every patch through ``patch`` (a pytest.MonkeyPatch)."""
    # 1. The autotuner times each config on a GPU: equal fake timings make it take the first config.
    patch.setattr(autotuner.Autotuner, "_bench", lambda self, *args, config, **meta: [0.0, 0.0, 0.0])
    # 2. Loop variables as tensors.
    patch.setattr(interpreter.FunctionRewriter, "ast_transformer", _TensorLoopVariables())
    # 3.-5. bf16 in tl.dot (its result typed by the accumulator), binary element-wise ops, casts,
    # reductions and scans: the ops that see bf16 operands in these kernels (the others, e.g. tl.exp,
    # get fp32 after the kernels' casts; a bf16 operand there would fail the comparison or raise).
    patch.setattr(InterpreterBuilder, "create_dot", _in_fp32(InterpreterBuilder.create_dot, 2))
    patch.setattr(InterpreterBuilder, "binary_op", _in_fp32(InterpreterBuilder.binary_op, 0))
    patch.setattr(InterpreterBuilder, "cast_impl", _cast)
    patch.setattr(ReduceScanOpInterface, "apply", _reduce_or_scan)
    # 6. CUDA device queries on CPU tensors.
    patch.setattr(torch.cuda, "device", _device)
    patch.setattr(torch.cuda, "get_device_properties",
                  lambda device=None: SimpleNamespace(multi_processor_count=SM_COUNT))
