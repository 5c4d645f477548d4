"""fla's and mamba-ssm's real Triton kernels, run by Triton's interpreter on CPU tensors through
the wrappers of ``oryx_megatron.ops.cuda``, against the torch ops in fp64 on the same values:
outputs, final states, and gradients of a random projection of outputs + states w.r.t. every
input. Run by ``make test-kernels``; docs/gpu.md ("Kernels on CPU") says what this cannot check."""

import importlib
import inspect
import os
from collections import Counter
from typing import Dict

import pytest

if os.environ.get("TRITON_INTERPRET") != "1":  # with it, a missing fla or mamba_ssm is an error, not a skip
    pytest.skip("Triton interpreter tests: run `make test-kernels` (TRITON_INTERPRET=1 before triton is imported)",
                allow_module_level=True)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

from oryx_megatron import ops  # noqa: E402
from oryx_megatron.ops import Documents, cuda  # noqa: E402
from oryx_megatron.ops import probe as probing  # noqa: E402
from tests.kernels import triton_cpu  # noqa: E402

# fla says so when Triton has no GPU driver (the interpreter needs none)
pytestmark = pytest.mark.filterwarnings("ignore:Triton is not supported on current platform:UserWarning")

# Relative error max |x - ref| / max |ref| of every output, state and gradient. Measured on these
# cases (docs/gpu.md, "Kernels on CPU"): fp32 <= 5.7e-7 (the interpreter computes fp32 exactly: no
# TF32), bf16 <= 5.6e-3 (the rounding of bf16 inputs and outputs; an H200 gave 0.15-0.7%).
RTOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}  # bf16: the GPU check's KERNEL_RTOL
MUTANT_ERR = 1e-1  # what each wrapper bug below exceeds (measured 0.49-7.6; the outputs it spares: <= 1.3e-7)

BATCH, SEQ, HEADS, D_K, D_V = 2, 100, 2, 16, 32  # 100 tokens: a partial last chunk of 64
FP32_INPUTS = {"g", "beta", "dt", "A", "D", "initial_state", "state"}  # as the layers pass them
OUTPUTS = {
    "chunk_gated_delta_rule": ("o", "final_state"),
    "gated_delta_rule_step": ("o", "new_state"),
    "ssd_chunk_scan": ("y", "final_state"),
    "ssd_step": ("y", "new_state"),
    "gated_rms_norm": ("o",),
}
BACKWARD = {"chunk_gated_delta_rule", "ssd_chunk_scan", "gated_rms_norm"}  # the step kernels have none
ENTRY_POINTS = {  # wrapper -> (module, the library function it calls)
    "chunk_gated_delta_rule": ("fla.ops.gated_delta_rule", "chunk_gated_delta_rule"),
    "gated_delta_rule_step": ("fla.ops.gated_delta_rule", "fused_recurrent_gated_delta_rule"),
    "ssd_chunk_scan": ("mamba_ssm.ops.triton.ssd_combined", "mamba_chunk_scan_combined"),
    "ssd_step": ("mamba_ssm.ops.triton.selective_state_update", "selective_state_update"),
    "gated_rms_norm": ("mamba_ssm.ops.triton.layernorm_gated", "rmsnorm_fn"),
}
FP32, BF16 = torch.float32, torch.bfloat16
CASES = [  # (wrapper, activations' dtype, initial state, other arguments)
    ("chunk_gated_delta_rule", FP32, False, {}),
    ("chunk_gated_delta_rule", FP32, True, {"scale": 0.3}),
    ("chunk_gated_delta_rule", BF16, False, {"output_final_state": False}),
    ("chunk_gated_delta_rule", BF16, True, {}),
    ("gated_delta_rule_step", FP32, True, {}),
    ("gated_delta_rule_step", BF16, True, {"scale": 0.3}),
    ("ssd_chunk_scan", FP32, False, {}),
    ("ssd_chunk_scan", FP32, True, {}),
    ("ssd_chunk_scan", BF16, False, {"output_final_state": False}),
    ("ssd_chunk_scan", BF16, True, {}),
    ("ssd_step", FP32, True, {}),
    ("ssd_step", FP32, True, {"D": None}),
    ("ssd_step", BF16, True, {}),
    ("gated_rms_norm", FP32, False, {}),
    ("gated_rms_norm", BF16, False, {}),
]
# packed documents (data.reset_at_eod): sample 0 starts documents at 30, 64 (a chunk edge) and 65 (a
# document of one token), sample 1 is one document; fla takes them as cu_seqlens, mamba-ssm as seq_idx
DOCUMENTS = torch.stack([torch.repeat_interleave(torch.arange(4), torch.tensor([30, 34, 1, 35])),
                         torch.zeros(SEQ, dtype=torch.long)])
CASES += [(op, dtype, with_state, {"documents": Documents(DOCUMENTS)})
          for op in ("chunk_gated_delta_rule", "ssd_chunk_scan") for dtype in (FP32, BF16) for with_state in (False, True)]


def case_id(case) -> str:
    op, dtype, with_state, kwargs = case
    return "-".join([op, str(dtype).split(".")[-1], "state" if with_state else "no_state",
                     *(k if isinstance(v, Documents) else f"{k}={v}" for k, v in kwargs.items())])


def kernel_inputs(op: str, dtype: torch.dtype, with_state: bool, d_k: int, d_v: int) -> Dict[str, torch.Tensor]:
    """Keyword tensors of one call: activations in ``dtype``, FP32_INPUTS in fp32."""
    gen = torch.Generator().manual_seed(0)
    seq = (SEQ,) if op in BACKWARD else ()  # the step ops take one token
    b, h = BATCH, HEADS

    def rand(*size):
        return torch.randn(*size, generator=gen, dtype=torch.float64)

    if op in ("chunk_gated_delta_rule", "gated_delta_rule_step"):
        args = {name: F.normalize(rand(b, *seq, h, d_k), dim=-1) for name in ("q", "k")}  # [b, (s,) h, d_k]
        args.update(v=rand(b, *seq, h, d_v), beta=rand(b, *seq, h).sigmoid(),
                    g=F.logsigmoid(rand(b, *seq, h) + 4))  # ~-0.03: the state outlives the sequence
        state = rand(b, h, d_k, d_v)  # [b, h, d_k, d_v]
    elif op in ("ssd_chunk_scan", "ssd_step"):
        args = {"x": rand(b, *seq, h, d_v), "B": rand(b, *seq, h, d_k), "C": rand(b, *seq, h, d_k),  # p = d_v, n = d_k
                "dt": F.softplus(rand(b, *seq, h) - 4), "A": -(rand(h) / 2).exp(), "D": rand(h)}  # dt A ~-0.02
        state = rand(b, h, d_k, d_v)  # [b, h, n, p]
    else:  # gated_rms_norm
        args = {"y": rand(b, *seq, h, d_v), "gate": rand(b, *seq, h, d_v), "weight": 1 + rand(h * d_v) / 10}
    if with_state:
        args["initial_state" if op in BACKWARD else "state"] = state
    return {name: t.to(FP32 if name in FP32_INPUTS else dtype) for name, t in args.items()}


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    assert x.shape == ref.shape
    return ((x.double() - ref).abs().max() / ref.abs().max()).item()


def errors(wrapper, op: str, dtype: torch.dtype, with_state: bool, kwargs: dict,
           d_k: int = D_K, d_v: int = D_V, backward: bool = True) -> Dict[str, float]:
    """Relative errors of ``wrapper`` (op's function of ops/cuda.py, or a mutant) against the torch op
    in fp64 on the same values, by output and by gradient ("d" + input name)."""
    backward = backward and op in BACKWARD
    args = {**kernel_inputs(op, dtype, with_state, d_k, d_v), **kwargs}
    inputs = {name: t.requires_grad_(backward) for name, t in args.items() if torch.is_tensor(t) and t.is_floating_point()}
    ref_inputs = {name: t.detach().double().requires_grad_(backward) for name, t in inputs.items()}
    got, want = wrapper(**{**args, **inputs}), ops.OPS[op].torch(**{**args, **ref_inputs})
    got, want = (t if isinstance(t, tuple) else (t,) for t in (got, want))
    assert [t is None for t in got] == [t is None for t in want]
    errs = {name: rel_err(x, ref) for name, x, ref in zip(OUTPUTS[op], got, want) if ref is not None}
    if backward:
        gen = torch.Generator().manual_seed(1)
        weights = [torch.randn(ref.shape, generator=gen, dtype=torch.float64) for ref in want if ref is not None]
        grads, ref_grads = (torch.autograd.grad(sum((t.double() * w).sum() for t, w in zip(outs, weights)),
                                                list(leaves.values()))
                            for outs, leaves in ((got, inputs), (want, ref_inputs)))
        errs.update({f"d{name}": rel_err(g, ref) for name, g, ref in zip(inputs, grads, ref_grads)})
    return errs


@pytest.fixture(scope="module", autouse=True)
def triton_on_cpu():
    """The answers to what the kernels ask of a GPU (triton_cpu), for this module's tests only."""
    with pytest.MonkeyPatch.context() as patch:
        triton_cpu.install(patch)
        yield


@pytest.fixture
def kernel_calls(monkeypatch) -> Counter:
    """CPU tensors routed to the kernels (the wrappers send them to the torch ops), fp32 included
    (fla's chunk wrapper sends fp32 to the torch op: here fp32 checks its arguments precisely), and
    the calls counted: of each library entry point, and Triton kernel launches."""
    monkeypatch.setattr(cuda, "_kernel_takes", lambda x, dtypes=None: True)
    calls = Counter()

    def counted(fn, key):
        def call(*args, **kwargs):
            calls[key] += 1
            return fn(*args, **kwargs)
        return call

    for module, name in ENTRY_POINTS.values():
        module = importlib.import_module(module)
        monkeypatch.setattr(module, name, counted(getattr(module, name), name))
    monkeypatch.setattr(InterpretedFunction, "run", counted(InterpretedFunction.run, "triton launch"))
    return calls


@pytest.mark.parametrize("op, dtype, with_state, kwargs", CASES, ids=[case_id(c) for c in CASES])
def test_kernel_equals_torch_op(op, dtype, with_state, kwargs, kernel_calls):
    errs = errors(getattr(cuda, op), op, dtype, with_state, kwargs)
    assert kernel_calls[ENTRY_POINTS[op][1]] == 1 and kernel_calls["triton launch"] > 0
    assert {name: e for name, e in errs.items() if not e <= RTOL[dtype]} == {}, errs


def mutant(name: str, old: str, new: str):
    """The wrapper ``name`` of ops/cuda.py with ``old`` replaced by ``new`` in its source."""
    source = inspect.getsource(getattr(cuda, name))
    assert source.count(old) == 1, f"{old!r} is not once in cuda.{name}"
    namespace = {}
    exec(compile(source.replace(old, new), cuda.__file__, "exec"), vars(cuda), namespace)
    return namespace[name]


MUTANTS = [  # (wrapper, its source, the bug, the outputs the bug must spoil)
    ("ssd_chunk_scan", "initial_state.transpose(-1, -2).contiguous()", "initial_state.contiguous()",
     {"y", "final_state"}),
    ("ssd_chunk_scan", "final_state.transpose(-1, -2)", "final_state", {"final_state"}),
    ("ssd_step", "state.transpose(-1, -2).clone(", "state.clone(", {"y", "new_state"}),
    ("chunk_gated_delta_rule", "g=g,", "g=-g,", {"o", "final_state"}),
]


MUTANTS += [  # packed documents: each sample's last document's state; the resets themselves
    ("chunk_gated_delta_rule", "final_state[docs.last]", "final_state[docs.first]", {"final_state"},
     {"documents": Documents(DOCUMENTS)}),
    ("ssd_chunk_scan", "seq_idx=seq_idx,", "seq_idx=None,", {"y", "final_state"}, {"documents": Documents(DOCUMENTS)}),
]


@pytest.mark.parametrize("op, old, new, spoiled, kwargs", [m if len(m) == 5 else (*m, {}) for m in MUTANTS],
                         ids=[f"{m[0]}: {m[2] or 'no ' + m[1]}" for m in MUTANTS])
def test_comparison_catches_wrapper_bug(op, old, new, spoiled, kwargs, kernel_calls):
    """The forward comparison on a wrapper with a bug, with square states (d_k = d_v): where a
    skipped state transpose is no shape error."""
    errs = errors(mutant(op, old, new), op, FP32, True, kwargs, d_k=D_K, d_v=D_K, backward=False)
    assert kernel_calls[ENTRY_POINTS[op][1]] == 1
    assert {name for name, e in errs.items() if not e <= MUTANT_ERR} == spoiled, errs


@pytest.mark.parametrize("op", OUTPUTS)
def test_the_runtime_probe_accepts_the_real_kernel(op, kernel_calls, capsys):
    """ops.probe's own comparison (PROBE_SHAPE, bf16 activations, an initial state; its seed) on the real
    kernel: within the probe's tolerance. The errors are printed: PROBE_TOLERANCE is calibrated on them."""
    errs = probing.probe_errors(op, getattr(cuda, op), ops.OPS[op].torch, "cpu", backward=True)
    with capsys.disabled():
        print(f"\nprobe errors of {op} at {probing.PROBE_SHAPE}:",
              ", ".join(f"{k} {v:.2e}" for k, v in errs.items()))
    assert kernel_calls[ENTRY_POINTS[op][1]] == 1
    assert probing.verdict(op, errs) is None, errs
