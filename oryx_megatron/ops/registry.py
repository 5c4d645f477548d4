"""The kernel ops, each declared once: its torch op, its optional CUDA kernel, when that kernel may run and
the inputs of its one-time check. ``get_kernels`` serves every registered op; a mixer's own module declares
its op beside the mixer and registers it on import:

    register_op(KernelOp("chunk_gla", torch=chunk_gla, outputs=("o", "final_state"), backward=True))
    kernels = get_kernels()      # kernels.chunk_gla(...); kernels.names["chunk_gla"] == "torch"

The project's own ops are declared in ``ops/builtin.py``.
"""

from dataclasses import dataclass, field
from typing import Callable, Dict, Mapping, Optional, Tuple

import torch

# A probe's inputs: argument name -> (fp64 values, the dtype the kernel gets), or a plain value (ops.probe)
Values = Dict[str, object]
# (shape (b, s, h, d), with an initial state, generator) -> Values of one valid call
ProbeInputs = Callable[[Tuple[int, int, int, int], bool, torch.Generator], Values]


@dataclass(frozen=True, eq=False)
class KernelOp:
    """One op of ``Kernels``.

    ``torch``: the pure-PyTorch op (CPU, and the oracle every kernel is checked against). ``cuda``: the CUDA
    kernel with the same signature (it may send inputs it does not take to the torch op), or None: the torch op
    runs everywhere (``names``: "torch"; on a CUDA machine a warning says so, whatever the backend). ``implementation``: the kernel's name in
    ``Kernels.names`` ("fla", "mamba_ssm", ..). ``requires``: the conditions under which the kernel may run
    (``selection.Package``: a distribution at a minimum version; ``selection.KnownIssue``: a version or
    architecture where it refuses or mis-computes, possibly its backward only). ``probe_inputs``: the values
    of one valid call (``ProbeInputs``: activations bf16, gates and states fp32, as the layers pass them), which
    the one-time check (``ops.probe``) runs through both implementations; ``outputs``: the names of the op's
    outputs, in order; ``backward``: whether it has one (the check then compares every input's gradient);
    ``tolerance``: error name ("o", "dg", ..) -> the check's relative tolerance where not PROBE_TOLERANCE."""

    name: str
    torch: Callable
    cuda: Optional[Callable] = None
    implementation: str = "cuda"
    requires: Tuple[object, ...] = ()
    probe_inputs: Optional[ProbeInputs] = None
    outputs: Tuple[str, ...] = ()
    backward: bool = False
    tolerance: Mapping[str, float] = field(default_factory=dict)


OPS: Dict[str, KernelOp] = {}  # name -> declaration, in registration order: the attributes of ``Kernels``


def register_op(op: KernelOp) -> KernelOp:
    """Adds ``op`` to every ``get_kernels`` from now on (also after earlier calls: selection is cached per
    registry state). ValueError names a name taken by another declaration, and a CUDA kernel without the
    inputs and output names of its one-time check."""
    if op.name == "names" or op.name.startswith("_") or not op.name.isidentifier():
        raise ValueError(f"kernel op {op.name!r}: not a valid op name (an identifier, not 'names' nor _private)")
    if OPS.get(op.name, op) is not op:
        raise ValueError(f"kernel op {op.name!r} is already declared, by {_where(OPS[op.name])}")
    if op.cuda is not None and (op.probe_inputs is None or not op.outputs):
        raise ValueError(f"kernel op {op.name!r}: a CUDA kernel needs probe_inputs and outputs (its one-time check)")
    OPS[op.name] = op
    return op


def cuda_ops() -> Tuple[str, ...]:
    """The registered ops that declare a CUDA kernel (what the probe and the GPU check compare)."""
    return tuple(name for name, op in OPS.items() if op.cuda is not None)


def _where(op: KernelOp) -> str:
    return f"{op.torch.__module__}.{op.torch.__qualname__}"
