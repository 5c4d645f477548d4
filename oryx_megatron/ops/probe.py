"""The one-time check of a CUDA kernel against its torch op before ``get_kernels`` chooses it, and the
verdicts a GPU session recorded instead (``$ORYX_KERNEL_PROBES``).

A kernel is called as the layers call it (activations bf16; gates, decays, A, D and recurrent states
fp32) on valid values (its ``KernelOp.probe_inputs``: L2-normalised GDN keys, log decays <= 0, beta in
(0, 1), dt > 0, A < 0, ..) and compared with the torch op in fp64 on the same values: outputs, states and,
for the ops with a backward, the gradients of a random projection of them w.r.t. every input. This is the
runtime's own check; the GPU check (``oryx_megatron.checks``) runs the same comparison at its sizes and cases.
"""

import functools
import json
import math
import os
import zlib
from pathlib import Path
from typing import Callable, Dict, Optional, Tuple

import torch

from .attention import BlockReads
from .registry import OPS, Values

ACT, GATE = torch.bfloat16, torch.float32  # activations bf16; gates and recurrent states fp32, as the layers pass them
PROBE_SHAPE = (1, 256, 2, 64)  # b, s, h, d: two blocks of FlexAttention, four chunks of the scans
# The relative error (rel_err) a kernel may have at PROBE_SHAPE. Measured there (docs/gpu.md, "The probe's
# tolerance"): the torch ops themselves on the bf16 inputs, the floor of bf16 rounding, <= 7.8e-3 (the
# attention ops' dk; outputs <= 6.6e-3, fp32 states <= 1.1e-7); fla's and mamba-ssm's Triton kernels under
# Triton's interpreter <= 5.3e-3 but for fla's dg (its KernelOp.tolerance); an H200 at the GPU check's 16x
# larger size 1.5e-3 to 7e-3 (fla, mamba-ssm). The torch ops with one output or one input's gradient 2% off err
# by 1.58e-2 (GDN dq: a bf16 gradient rounded twice) to 2.7e-2. 1.2e-2 is 1.5x the worst good error, 1.3x under
# the least 2%-off one.
PROBE_TOLERANCE = 1.2e-2
PROBES_ENV_VAR = "ORYX_KERNEL_PROBES"  # a JSON file of verdicts: {"verdicts": {op: {"forward": .., "backward": ..,
#                                       "tolerance": tolerance(op), "errors": {direction: {name: error}}}}}


def kernel_inputs(op: str, shape: Tuple[int, int, int, int], with_state: bool, gen: torch.Generator) -> Values:
    """Keyword arguments of one call of ``op`` at ``shape`` (b, s, h, d), from its ``KernelOp.probe_inputs``:
    name -> (fp64 values, the dtype the kernel gets), or a plain value. Step ops take one token (no sequence
    axis) and always a state."""
    return OPS[op].probe_inputs(shape, with_state, gen)


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    """max |x - ref| / max |ref| in fp64 (the absolute error when ref is all zeros)."""
    diff = (x.double() - ref.double()).abs().max().item()
    scale = ref.double().abs().max().item()
    return diff / scale if scale else diff


class KernelCall:
    """One op on one set of values, through ``kernel`` (in the values' dtypes) and ``reference`` (the
    torch op, in fp64), run on first use so that a failure lands with the caller that asked."""

    def __init__(self, op: str, values: Values, device, kernel: Callable, reference: Callable):
        self.op, self.values, self.device, self.kernel, self.reference = op, values, device, kernel, reference
        self._run = None  # (inputs, ref_inputs, outputs, ref_outputs)

    def run(self):
        if self._run is None:
            grad = OPS[self.op].backward
            inputs = {n: _on(value, self.device, grad) for n, value in self.values.items()}
            ref_inputs = {n: _on((t, torch.float64), self.device, grad) if _differentiable(t) else t
                          for n, t in inputs.items()}  # same values
            got, want = self.kernel(**inputs), self.reference(**ref_inputs)
            self._run = (inputs, ref_inputs, *(t if isinstance(t, tuple) else (t,) for t in (got, want)))
        return self._run

    def forward_errors(self) -> Dict[str, float]:
        _, _, got, want = self.run()
        return {name: rel_err(x, ref) for name, x, ref in zip(OPS[self.op].outputs, got, want)}

    def backward_errors(self) -> Dict[str, float]:
        """Gradients of sum(w * output) over outputs and states, w random, w.r.t. every input."""
        inputs, ref_inputs, got, want = self.run()
        gen = torch.Generator().manual_seed(1)
        weights = [torch.randn(ref.shape, generator=gen, dtype=torch.float64).to(ref.device) for ref in want]
        grads, ref_grads = _grads(got, weights, inputs), _grads(want, weights, ref_inputs)
        return {f"d{name}": rel_err(grads[name], ref) if grads[name] is not None else math.inf
                for name, ref in ref_grads.items()}


def _differentiable(x) -> bool:
    return torch.is_tensor(x) and x.is_floating_point()


def _on(value, device, grad: bool):
    """A kernel argument: (fp64 values, dtype) -> a tensor on ``device`` (a leaf requiring grad when
    ``grad`` and floating); the block-sparse read pattern on ``device``."""
    if isinstance(value, BlockReads):
        return BlockReads(value.read.to(device), value.block_size)
    tensor, dtype = value
    tensor = tensor.detach().to(device, dtype)
    return tensor.requires_grad_(grad) if tensor.is_floating_point() else tensor


def _grads(outputs, weights, leaves: Dict[str, torch.Tensor]) -> Dict[str, Optional[torch.Tensor]]:
    leaves = {name: t for name, t in leaves.items() if _differentiable(t)}
    loss = sum((t.double() * w).sum() for t, w in zip(outputs, weights))
    return dict(zip(leaves, torch.autograd.grad(loss, list(leaves.values()), allow_unused=True)))


def tolerance(op: str) -> Dict[str, float]:
    """The relative error the probe allows ``op``: by error name ("o", "dq", ..) where its
    ``KernelOp.tolerance`` names one, "*" for every other."""
    return {"*": PROBE_TOLERANCE, **OPS[op].tolerance}


def probe_errors(op: str, kernel: Callable, reference: Callable, device, backward: bool) -> Dict[str, float]:
    """Relative errors of ``kernel`` against ``reference`` at PROBE_SHAPE with an initial state: every
    output and state, and (``backward``, for the ops with one) every input gradient."""
    gen = torch.Generator().manual_seed(zlib.crc32(op.encode()))
    call = KernelCall(op, kernel_inputs(op, PROBE_SHAPE, True, gen), device, kernel, reference)
    errors = call.forward_errors()
    if backward and OPS[op].backward:
        errors.update(call.backward_errors())
    return errors


def verdict(op: str, errors: Dict[str, float]) -> Optional[str]:
    """None when every error is within ``tolerance(op)``, else the one furthest past its tolerance."""
    allowed = tolerance(op)
    limits = {name: allowed.get(name, allowed["*"]) for name in errors}
    bad = [name for name, err in errors.items() if not err <= limits[name]]
    if not bad:
        return None
    worst = max(bad, key=lambda name: errors[name] / limits[name])
    return (f"its one-time check differs from the torch op: {worst} relative error {errors[worst]:.3g} "
            f"> {limits[worst]}")


def measure(op: str, kernel: Callable, reference: Callable, device, backward: bool
            ) -> Tuple[Optional[str], Dict[str, float]]:
    """The probe itself: (its verdict, the errors it measured: {} where the kernel raised)."""
    try:
        errors = probe_errors(op, kernel, reference, device, backward)
    except Exception as e:  # a kernel that refuses, or fails to compile
        return f"its one-time check raised {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}", {}
    return verdict(op, errors), errors


@functools.lru_cache(maxsize=None)
def probe(op: str, kernel: Callable, reference: Callable, device="cuda", backward: bool = True) -> Optional[str]:
    """None when ``kernel`` agrees with the torch op within ``tolerance(op)`` (forward and, ``backward``,
    backward), else why not (an exception counts). Where a GPU session recorded a verdict for ``op``
    under this tolerance (``$ORYX_KERNEL_PROBES``), that verdict, without running anything: a kernel
    that crashed its session's probe is not run again."""
    recorded = recorded_verdicts().get(op)
    if recorded is not None:
        return recorded["backward" if backward else "forward"]
    return measure(op, kernel, reference, device, backward)[0]


def recorded_verdicts() -> Dict[str, dict]:
    """op -> {"forward": reason or None, "backward": reason or None, "tolerance", "errors"} from the file
    ``$ORYX_KERNEL_PROBES`` names ({} when unset), those of registered ops recorded under ``tolerance(op)`` only:
    one under another tolerance (none: a file from before tolerances were recorded) is probed again.
    A file that cannot be read is an error, never a reason to probe again."""
    path = os.environ.get(PROBES_ENV_VAR)
    if not path:
        return {}
    try:
        verdicts = json.loads(Path(path).read_text())["verdicts"]
        return {op: found for op, found in verdicts.items() if op in OPS and found.get("tolerance") == tolerance(op)}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"${PROBES_ENV_VAR}={path}: not a file of kernel probe verdicts "
                         f"({type(e).__name__}: {e})") from None
