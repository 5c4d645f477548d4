"""Backend selection (`get_kernels`), the one-time probe of a kernel against its torch op, and the CUDA
wrappers' torch fallback on CPU tensors. Without a GPU the wrappers run the torch op, so no test here checks a
CUDA kernel (the GPU check and `make test-kernels` do); what the probe catches is proved with mutants of the
torch ops put in a kernel's place."""

import dataclasses
import json
import re

import pytest
import torch
import torch.nn.functional as F

from oryx_megatron import ops
from oryx_megatron.ops import BACKEND_ENV_VAR, OPS, KernelOp, Kernels, cuda, get_kernels, register_op, selection
from oryx_megatron.ops import probe as probing
from oryx_megatron.ops.builtin import BUILTIN
from oryx_megatron.ops.selection import KernelEnvironment

BUILTIN_OPS = tuple(op.name for op in BUILTIN)  # the project's own: each has a CUDA kernel

no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only behaviour")


def test_torch_backend_is_all_torch(monkeypatch):
    monkeypatch.setenv(BACKEND_ENV_VAR, "cuda")  # an explicit backend ignores the variable
    kernels = get_kernels("torch")
    assert set(kernels.names) == set(OPS) and set(kernels.names.values()) == {"torch"}
    for op in OPS:
        assert getattr(kernels, op) is OPS[op].torch
    for op in BUILTIN_OPS:
        assert OPS[op].torch is getattr(ops, op)  # the public torch op of each of the project's ops


@no_cuda
def test_auto_on_cpu_machine_is_torch(monkeypatch):
    monkeypatch.delenv(BACKEND_ENV_VAR, raising=False)
    assert set(get_kernels().names.values()) == {"torch"}
    assert set(get_kernels("auto").names.values()) == {"torch"}


def test_env_var_is_honoured(monkeypatch):
    monkeypatch.setenv(BACKEND_ENV_VAR, "torch")
    assert set(get_kernels().names.values()) == {"torch"}
    monkeypatch.setenv(BACKEND_ENV_VAR, "tpu")
    with pytest.raises(ValueError, match=f"'tpu'.*{BACKEND_ENV_VAR}"):
        get_kernels()


def test_unknown_backend_raises_value_error():
    with pytest.raises(ValueError, match="'triton'.*auto, torch, cuda"):
        get_kernels("triton")


@no_cuda
def test_cuda_backend_without_cuda_raises_clearly():
    with pytest.raises(RuntimeError, match="CUDA is not available") as info:
        get_kernels("cuda")
    assert "chunk_gated_delta_rule" in str(info.value)
    assert selection.refusal("ssd_chunk_scan", KernelEnvironment.detect()) == "CUDA is not available"


def test_kernels_is_read_only_and_complete():
    kernels = get_kernels("torch")
    assert isinstance(kernels, Kernels) and BUILTIN_OPS == (
        "causal_conv1d", "causal_conv1d_step", "chunk_gated_delta_rule", "gated_delta_rule_step", "ssd_chunk_scan",
        "ssd_step", "causal_attention", "block_sparse_causal_attention", "gated_rms_norm")
    assert tuple(kernels.names)[:9] == BUILTIN_OPS  # then the ops registered outside the package (the tests')
    with pytest.raises(AttributeError, match="Kernels is read-only: cannot set 'ssd_step'"):
        kernels.ssd_step = None
    with pytest.raises(AttributeError, match=r"no kernel op 'chunk_rwkv': the registered ops are causal_conv1d, "):
        kernels.chunk_rwkv


def test_cuda_wrappers_fall_back_to_torch_on_cpu_tensors():
    """The wrappers' routing by device: CPU tensors go to the torch op itself (bitwise the same result)."""
    gen = torch.Generator().manual_seed(0)
    rand = lambda *shape: torch.randn(*shape, generator=gen, dtype=torch.float64)  # noqa: E731
    b, s, h, d = 2, 9, 2, 4
    q, k = (F.normalize(rand(b, s, h, d), dim=-1) for _ in range(2))
    v, g, beta, state = rand(b, s, h, d), -rand(b, s, h).abs(), rand(b, s, h).sigmoid(), rand(b, h, d, d)
    x, weight, bias, conv_state = rand(b, s, 3), rand(3, 4), rand(3), rand(b, 3, 3)
    dt, A, D = rand(b, s, h).exp(), -rand(h).exp(), rand(h)
    calls = {
        "chunk_gated_delta_rule": (q, k, v, g, beta, None, state, True, 4),
        "gated_delta_rule_step": (q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], state),
        "ssd_chunk_scan": (v, dt, A, k, q, D, state, True, 4),
        "ssd_step": (v[:, 0], dt[:, 0], A, k[:, 0], q[:, 0], state, D),
        "causal_conv1d": (x, weight, bias, conv_state),
        "causal_conv1d_step": (x[:, 0], conv_state, weight, bias),
        "causal_attention": (q, k, v),
        "block_sparse_causal_attention": (q, k, v, ops.BlockReads(rand(b, s) > 0, 4)),
    }
    for op, args in calls.items():
        got, want = getattr(cuda, op)(*args), getattr(ops, op)(*args)
        for a, b_ in zip(*(t if isinstance(t, tuple) else (t,) for t in (got, want))):
            assert torch.equal(a, b_), op


# ---- selection with the conditions injected (nothing here runs a CUDA kernel) ----

GOOD = (("triton", "3.7.1"), ("fla-core", "0.6.0"), ("mamba-ssm", "2.3.2.post1"), ("causal-conv1d", "1.5.2"))


def hopper(*versions, nvcc=False, capability=(9, 0)) -> KernelEnvironment:
    return KernelEnvironment(cuda=True, capability=capability, versions=tuple(versions), nvcc=nvcc)


def with_version(dist: str, version: str):
    return tuple((d, version if d == dist else v) for d, v in GOOD)


def passing_probe(op, backward=True):
    return None


@pytest.fixture
def fresh_selection():
    """Selection results are cached per (backend, environment, probe): forget the ones a test made."""
    ops._select.cache_clear()
    yield
    ops._select.cache_clear()


def test_a_complete_environment_refuses_nothing():
    assert {op: selection.refusal(op, hopper(*GOOD)) for op in BUILTIN_OPS} == dict.fromkeys(BUILTIN_OPS)
    assert ops.cuda_ops() == BUILTIN_OPS  # the tests' op (tests/mixers/gla.py) is torch only


@pytest.mark.parametrize("triton", ["3.4.0", "3.6.0", "3.7.0"])
def test_fla_backward_refused_on_hopper_with_the_triton_of_fla_issue_640(triton):
    env = hopper(*with_version("triton", triton))
    reason = selection.refusal("chunk_gated_delta_rule", env)
    assert f"Triton {triton} on a Hopper GPU (sm90)" in reason and "fla issue 640" in reason
    assert selection.refusal("chunk_gated_delta_rule", env, backward=False) is None  # issue 640 is the backward's
    assert selection.refusal("gated_delta_rule_step", env) is None  # the decode kernel has no backward
    assert selection.refusal("chunk_gated_delta_rule", hopper(*with_version("triton", triton), ("tilelang", "0.1.9"),
                                                               nvcc=True)) is None
    assert "fla issue 640" in selection.refusal(  # tilelang needs nvcc
        "chunk_gated_delta_rule", hopper(*with_version("triton", triton), ("tilelang", "0.1.9")))
    assert selection.refusal("chunk_gated_delta_rule", hopper(*with_version("triton", triton), capability=(8, 0))) is None


def test_missing_and_old_packages_are_named():
    env = hopper(*[(d, v) for d, v in GOOD if d != "mamba-ssm"])
    assert selection.refusal("ssd_step", env) == "mamba-ssm is not installed (pip install 'mamba-ssm>=2.2.0')"
    old = hopper(*with_version("fla-core", "0.4.2"))
    assert selection.refusal("chunk_gated_delta_rule", old) == (
        "fla-core 0.4.2 is older than 0.6.0, the oldest version this project supports")
    legacy = hopper(*[(d, v) for d, v in GOOD if d != "fla-core"], ("flash-linear-attention", "0.3.0"))
    assert "fla-core 0.3.0 is older" in selection.refusal("chunk_gated_delta_rule", legacy)


def test_auto_falls_back_per_op_and_logs_why(caplog, monkeypatch, fresh_selection):
    monkeypatch.delenv(BACKEND_ENV_VAR, raising=False)
    env = hopper(*with_version("triton", "3.6.0"))
    with caplog.at_level("WARNING", logger="oryx_megatron.ops"):
        kernels = get_kernels("auto", env=env, probe=passing_probe)
    assert {op: kernels.names[op] for op in BUILTIN_OPS} == {"causal_conv1d": "causal_conv1d", "causal_conv1d_step": "causal_conv1d",
                             "chunk_gated_delta_rule": "fla without grad", "gated_delta_rule_step": "fla",
                             "ssd_chunk_scan": "mamba_ssm", "ssd_step": "mamba_ssm", "causal_attention": "sdpa",
                             "block_sparse_causal_attention": "flex_attention", "gated_rms_norm": "mamba_ssm"}
    assert kernels.ssd_step is cuda.ssd_step
    assert ("chunk_gated_delta_rule: fla without grad runs where no gradient is needed, the torch op where one is "
            "(training): Triton 3.6.0 on a Hopper GPU" in caplog.text)
    missing = hopper(*[(d, v) for d, v in GOOD if d != "mamba-ssm"])
    kernels = get_kernels("auto", env=missing, probe=passing_probe)
    assert kernels.names["ssd_chunk_scan"] == "torch" and kernels.ssd_chunk_scan is ops.ssd_chunk_scan


def test_a_backward_only_refusal_keeps_the_kernel_where_no_gradient_is_needed(monkeypatch, fresh_selection):
    """fla issue 640 concerns the gated delta rule's backward: prefill and evaluation keep fla's
    forward, training runs the torch op (forward and backward)."""
    calls = []

    def fla(*args, **kwargs):
        calls.append("fla")
        return ops.chunk_gated_delta_rule(*args, **kwargs)

    monkeypatch.setitem(OPS, "chunk_gated_delta_rule", dataclasses.replace(OPS["chunk_gated_delta_rule"], cuda=fla))
    kernels = get_kernels("auto", env=hopper(*with_version("triton", "3.6.0")), probe=passing_probe)
    args = call_arguments("chunk_gated_delta_rule")
    kernels.chunk_gated_delta_rule(**args)  # no input requires a gradient
    with torch.no_grad():
        kernels.chunk_gated_delta_rule(**{**args, "q": args["q"].requires_grad_()})
    assert calls == ["fla", "fla"]
    o, _ = kernels.chunk_gated_delta_rule(**args)  # q requires grad, grad mode on: the torch op
    o.sum().backward()
    assert calls == ["fla", "fla"] and args["q"].grad is not None


def test_a_kernel_whose_backward_fails_its_check_runs_only_without_grad(fresh_selection):
    def probe(op, backward=True):
        return "its one-time check differs from the torch op: grad0 relative error 1" if backward else None

    names = get_kernels("auto", env=hopper(*GOOD), probe=probe).names
    assert {op: names[op] for op in BUILTIN_OPS} == {op: f"{OPS[op].implementation} without grad" for op in BUILTIN_OPS}


def test_a_failed_probe_falls_back_and_cuda_backend_names_it():
    def probe(op, backward=True):
        return "its one-time check differs from the torch op: out0 relative error 1" if op == "ssd_step" else None

    assert get_kernels("auto", env=hopper(*GOOD), probe=probe).names["ssd_step"] == "torch"
    with pytest.raises(RuntimeError, match=r"kernel backend 'cuda' is unavailable here: ssd_step: its one-time check"):
        get_kernels("cuda", env=hopper(*GOOD), probe=probe)
    with pytest.raises(RuntimeError, match=r"chunk_gated_delta_rule \(backward\): Triton 3.6.0 on a Hopper GPU"):
        get_kernels("cuda", env=hopper(*with_version("triton", "3.6.0")), probe=passing_probe)


# ---- an op declared outside the package (a mixer's module): one KernelOp, registered ----

def scaled_sum(x, w):
    """y [b, s, h, d] = cumsum(x) * w: an op of the kind a mixer's module declares."""
    return x.cumsum(1) * w


def scaled_sum_inputs(shape, with_state, gen):
    b, s, h, d = shape
    return {"x": (torch.randn(b, s, h, d, generator=gen, dtype=torch.float64), torch.bfloat16),
            "w": (torch.randn(h, d, generator=gen, dtype=torch.float64), torch.float32)}


def declared(cuda_kernel=None, **fields):
    fields = {"cuda": cuda_kernel, "implementation": "mine", "requires": (selection.Package("my-kernels", "1.2"),),
              "probe_inputs": scaled_sum_inputs, "outputs": ("y",), "backward": True, **fields}
    return KernelOp("scaled_sum", scaled_sum, **fields)


@pytest.fixture
def registered():
    """Registers a declaration for one test, and forgets it (and the selections made with it) afterwards."""
    yield lambda op: register_op(op)
    OPS.pop("scaled_sum", None)
    ops._select.cache_clear()


def test_an_op_registered_after_a_first_selection_is_served_and_selected_by_its_conditions(registered, fresh_selection):
    env = hopper(*GOOD)
    assert "scaled_sum" not in get_kernels("auto", env=env, probe=passing_probe).names
    kernel = lambda x, w: scaled_sum(x, w)  # noqa: E731  (its "CUDA kernel")
    registered(declared(kernel))
    kernels = get_kernels("auto", env=env, probe=passing_probe)
    assert kernels.names["scaled_sum"] == "torch" and kernels.scaled_sum is scaled_sum  # my-kernels is missing
    assert get_kernels("torch").scaled_sum is scaled_sum
    kernels = get_kernels("auto", env=hopper(*GOOD, ("my-kernels", "1.2.0")), probe=passing_probe)
    assert kernels.names["scaled_sum"] == "mine" and kernels.scaled_sum is kernel
    with pytest.raises(RuntimeError, match=r"unavailable here: scaled_sum: my-kernels 1.1 is older than 1.2, the oldest version"):
        get_kernels("cuda", env=hopper(*GOOD, ("my-kernels", "1.1")), probe=passing_probe)


def test_an_op_without_a_cuda_kernel_runs_torch_and_a_cuda_machine_says_so(registered, fresh_selection, caplog):
    """Not silently torch, and not a refusal of backend 'cuda' for every model of the process (the GDN model's
    kernels run as CUDA kernels beside the tests' GLA mixer's torch ops)."""
    registered(declared(None, requires=(), probe_inputs=None, outputs=()))
    assert get_kernels("auto", env=hopper(*GOOD), probe=passing_probe).names["scaled_sum"] == "torch"
    kernels = get_kernels("cuda", env=hopper(*GOOD), probe=passing_probe)
    assert kernels.scaled_sum is scaled_sum and kernels.names["chunk_gated_delta_rule"] == "fla"
    assert f"scaled_sum: the torch op runs: no CUDA kernel is declared for it (in {__name__})" in caplog.messages
    assert "gla_step: the torch op runs: no CUDA kernel is declared for it (in tests.mixers.gla)" in caplog.messages


def test_a_registered_kernel_is_probed_through_its_own_inputs(registered, fresh_selection):
    """get_kernels' probe compares the kernel with the torch op on the values of the op's probe_inputs:
    a kernel 2% off is refused with the probe's reason, the torch op itself (bf16 against fp64) passes."""
    off = lambda x, w: scaled_sum(x, w) * MUTANT_FACTOR  # noqa: E731
    registered(declared(off, requires=()))

    def probe(op, backward=True):
        return probing.probe(op, OPS[op].cuda, OPS[op].torch, "cpu", backward)

    kernels = get_kernels("auto", env=hopper(*GOOD), probe=probe)
    assert kernels.names["scaled_sum"] == "torch"
    assert re.match(refusal("scaled_sum", "y"), probe("scaled_sum", backward=False) or "")
    errors = probing.probe_errors("scaled_sum", scaled_sum, scaled_sum, "cpu", backward=True)
    assert set(errors) == {"y", "dx", "dw"} and probing.verdict("scaled_sum", errors) is None


def test_a_declaration_names_what_is_wrong_with_it(registered):
    registered(declared(None))
    with pytest.raises(ValueError, match=r"'scaled_sum' is already declared, by tests.ops.test_ops_kernels.scaled_sum$"):
        register_op(declared(None))
    with pytest.raises(ValueError, match=r"kernel op 'names': not a valid op name"):
        register_op(KernelOp("names", scaled_sum))
    with pytest.raises(ValueError, match=r"kernel op 'other': a CUDA kernel needs probe_inputs and outputs"):
        register_op(KernelOp("other", scaled_sum, cuda=scaled_sum))
    assert "names" not in OPS and "other" not in OPS


def call_arguments(op: str, shape=(1, 16, 2, 8)) -> dict:
    """Keyword arguments of one call of ``op``: the probe's valid values, in the dtypes the layers pass."""
    values = probing.kernel_inputs(op, shape, True, torch.Generator().manual_seed(0))
    return {name: v[0].to(v[1]) if isinstance(v, tuple) else v for name, v in values.items()}


MUTANT_FACTOR = 1.02  # 2% off: the tolerance was 5e-2, and a GDN kernel with dq 2% off (error 1.6e-2) passed it
GRADIENTS = {  # the differentiable inputs of each sequence op: the probe compares the gradient of every one
    "causal_conv1d": ("x", "weight", "bias", "initial_state"),
    "chunk_gated_delta_rule": ("q", "k", "v", "g", "beta", "initial_state"),
    "ssd_chunk_scan": ("x", "dt", "A", "B", "C", "D", "initial_state"),
    "causal_attention": ("q", "k", "v"),
    "block_sparse_causal_attention": ("q", "k", "v"),
    "gated_rms_norm": ("y", "gate", "weight"),
}
OUTPUT_MUTANTS = [(op, name) for op in BUILTIN_OPS for name in OPS[op].outputs]
GRADIENT_MUTANTS = [(op, name) for op, names in GRADIENTS.items() for name in names]


def output_mutant(op: str, output: str):
    """The torch op with one output 2% off."""
    index = OPS[op].outputs.index(output)

    def kernel(**kwargs):
        out = getattr(ops, op)(**kwargs)
        if not isinstance(out, tuple):
            return out * MUTANT_FACTOR
        return tuple(t * MUTANT_FACTOR if i == index else t for i, t in enumerate(out))
    return kernel


def gradient_mutant(op: str, name: str):
    """The torch op, right in the forward, with the gradient of input ``name`` 2% off."""
    def kernel(**kwargs):
        x = kwargs[name].clone()  # the same values; what flows back through it to the input is scaled
        x.register_hook(lambda grad: grad * MUTANT_FACTOR)
        return getattr(ops, op)(**{**kwargs, name: x})
    return kernel


def refusal(op: str, name: str) -> str:
    """The probe's reason (a pattern) when error ``name`` of ``op`` is the one furthest past its tolerance."""
    allowed = probing.tolerance(op)
    limit = allowed.get(name, allowed["*"])
    return rf"its one-time check differs from the torch op: {name} relative error [0-9.e-]+ > {limit}$"


@pytest.mark.parametrize("op", BUILTIN_OPS)
def test_probe_accepts_the_torch_op_in_bf16(op):
    """The CUDA wrapper on CPU is the torch op: in bf16 against fp64 (the floor of bf16 rounding: measured
    <= 7.8e-3, docs/gpu.md) it stays inside the tolerance, so the tolerance does not refuse a right kernel;
    every output and every differentiable input's gradient is compared."""
    assert probing.probe(op, getattr(cuda, op), getattr(ops, op), "cpu") is None
    errors = probing.probe_errors(op, getattr(cuda, op), getattr(ops, op), "cpu", backward=True)
    assert set(errors) == {*OPS[op].outputs, *(f"d{name}" for name in GRADIENTS.get(op, ()))}
    assert probing.verdict(op, errors) is None, errors


@pytest.mark.parametrize("op,output", OUTPUT_MUTANTS, ids=[f"{op}-{name}" for op, name in OUTPUT_MUTANTS])
def test_probe_refuses_an_output_2_percent_off(op, output):
    assert re.match(refusal(op, output), probing.probe(op, output_mutant(op, output), getattr(ops, op), "cpu",
                                                       backward=False) or "")


@pytest.mark.parametrize("op,name", GRADIENT_MUTANTS, ids=[f"{op}-d{name}" for op, name in GRADIENT_MUTANTS])
def test_probe_refuses_a_gradient_2_percent_off_and_keeps_the_forward(op, name):
    """A wrong gradient is refused where the op has a backward, while calls without a gradient may still use it."""
    wrong = gradient_mutant(op, name)
    assert re.match(refusal(op, f"d{name}"), probing.probe(op, wrong, getattr(ops, op), "cpu") or "")
    assert probing.probe(op, wrong, getattr(ops, op), "cpu", backward=False) is None


def test_the_tolerance_is_looser_only_for_fla_chunk_gdns_dg():
    """fla's chunk kernel measured dg 1.52e-2 under the interpreter (make test-kernels); the rest keeps 1.2e-2,
    and the reason names the error furthest past its own tolerance."""
    assert probing.verdict("chunk_gated_delta_rule", {"o": 2e-3, "dg": 1.6e-2}) is None
    assert probing.verdict("chunk_gated_delta_rule", {"dg": 2e-2, "dq": 1.3e-2}) == (  # 2e-2 / 1.8e-2 > 1.3e-2 / 1.2e-2
        "its one-time check differs from the torch op: dg relative error 0.02 > 0.018")
    assert probing.verdict("chunk_gated_delta_rule", {"dg": 1.8e-2, "dq": 1.3e-2}) == (
        "its one-time check differs from the torch op: dq relative error 0.013 > 0.012")
    assert probing.verdict("ssd_chunk_scan", {"dA": 1.6e-2}) == (
        "its one-time check differs from the torch op: dA relative error 0.016 > 0.012")


def test_probe_rejects_a_kernel_that_raises():
    def refusing(*args, **kwargs):
        raise RuntimeError("Triton >= 3.4.0 on Hopper GPUs produces incorrect results")

    assert probing.probe("chunk_gated_delta_rule", refusing, ops.chunk_gated_delta_rule, "cpu") == (
        "its one-time check raised RuntimeError: Triton >= 3.4.0 on Hopper GPUs produces incorrect results")


@pytest.fixture
def fresh_probes():
    """Probe verdicts are cached per (op, kernel, reference, device, direction): forget the ones a test made."""
    probing.probe.cache_clear()
    yield
    probing.probe.cache_clear()


SEGFAULT = "its probe process was killed by SIGSEGV"


def crash(*args, **kwargs):
    raise AssertionError("a recorded kernel was run again")


def test_recorded_session_verdicts_are_returned_without_running_the_kernel(tmp_path, monkeypatch, fresh_probes):
    """A GPU session probes each kernel once, in a process of its own; later processes read its verdicts
    ($ORYX_KERNEL_PROBES), recorded under this tolerance, and never run a kernel whose probe crashed."""
    path = tmp_path / "kernel_probes.json"
    path.write_text(json.dumps({"verdicts": {
        "ssd_step": {"forward": SEGFAULT, "backward": SEGFAULT, "tolerance": probing.tolerance("ssd_step"),
                     "errors": {}},
        "chunk_gated_delta_rule": {"forward": None, "backward": "its one-time check differs: dq 0.3",
                                   "tolerance": probing.tolerance("chunk_gated_delta_rule"),
                                   "errors": {"forward": {"o": 2e-3}, "backward": {"o": 2e-3, "dq": 0.3}}}}}))
    monkeypatch.setenv(probing.PROBES_ENV_VAR, str(path))
    assert probing.probe("ssd_step", crash, ops.ssd_step, "cpu") == SEGFAULT
    assert probing.probe("chunk_gated_delta_rule", crash, ops.chunk_gated_delta_rule, "cpu", backward=False) is None
    assert probing.probe("chunk_gated_delta_rule", crash, ops.chunk_gated_delta_rule, "cpu") == (
        "its one-time check differs: dq 0.3")
    assert probing.probe("ssd_chunk_scan", cuda.ssd_chunk_scan, ops.ssd_chunk_scan, "cpu") is None  # not recorded: run
    path.write_text("{")
    probing.probe.cache_clear()
    with pytest.raises(ValueError, match=rf"\${probing.PROBES_ENV_VAR}={path}: not a file of kernel probe verdicts"):
        probing.probe("ssd_step", crash, ops.ssd_step, "cpu")


def test_a_verdict_recorded_under_another_tolerance_is_probed_again(tmp_path, monkeypatch, fresh_probes):
    """A verdict file of a checkout with another tolerance (the old 5e-2, or none: the format before tolerances
    were recorded) decides nothing: the kernel runs (here: raises, which the probe reports)."""
    path = tmp_path / "kernel_probes.json"
    path.write_text(json.dumps({"verdicts": {
        "ssd_step": {"forward": None, "backward": None, "tolerance": {"*": 5e-2}, "errors": {}},
        "chunk_gated_delta_rule": {"forward": None, "backward": None,
                                   "tolerance": probing.tolerance("ssd_step"), "errors": {}},  # no dg exception
        "gated_delta_rule_step": {"forward": SEGFAULT, "backward": SEGFAULT}}}))
    monkeypatch.setenv(probing.PROBES_ENV_VAR, str(path))
    assert probing.recorded_verdicts() == {}
    ran = "its one-time check raised AssertionError: a recorded kernel was run again"
    for op in ("ssd_step", "chunk_gated_delta_rule", "gated_delta_rule_step"):
        assert probing.probe(op, crash, OPS[op].torch, "cpu") == ran, op


def test_compile_is_seen_disabled_by_either_variable(monkeypatch):
    """torch.compile returns the function uncompiled under TORCHDYNAMO_DISABLE=1 while
    torch._dynamo.config.disable stays False: selection must read the variable itself."""
    from torch._dynamo import config as dynamo_config

    monkeypatch.setattr(dynamo_config, "disable", False)
    monkeypatch.setenv("TORCHDYNAMO_DISABLE", "1")
    assert not selection.compile_enabled()
    monkeypatch.setenv("TORCHDYNAMO_DISABLE", "0")
    assert selection.compile_enabled()
    monkeypatch.setattr(dynamo_config, "disable", True)  # TORCH_COMPILE_DISABLE=1
    assert not selection.compile_enabled()


def test_flex_attention_needs_torch_compile():
    """Under TORCHDYNAMO_DISABLE=1 FlexAttention would compute every block: the torch loop runs instead."""
    env = dataclasses.replace(hopper(*GOOD), compile=False)
    assert "TORCHDYNAMO_DISABLE=1" in selection.refusal("block_sparse_causal_attention", env)
    assert selection.refusal("block_sparse_causal_attention", hopper(*GOOD)) is None
    assert get_kernels("auto", env=env, probe=passing_probe).names["block_sparse_causal_attention"] == "torch"
