"""Which CUDA kernels may run here: the known version and architecture conditions, and a one-time
tiny forward + backward of each kernel against the torch op.

A kernel that would refuse or mis-compute is never chosen: ``refusal(op, env)`` names the reason
from the environment alone (no import, so conditions can be injected), ``probe(op)`` runs the
kernel once on the GPU and compares it with the torch op.
"""

import functools
import importlib
import importlib.metadata
import os
import shutil
from dataclasses import dataclass
from typing import Callable, Dict, Optional, Tuple

import torch
import torch.nn.functional as F

from .attention import BlockReads

# op -> (implementation name, the distribution that ships it, minimum version)
IMPLEMENTATIONS: Dict[str, Tuple[str, Optional[str], Optional[str]]] = {
    "causal_conv1d": ("causal_conv1d", "causal-conv1d", "1.4.0"),
    "causal_conv1d_step": ("causal_conv1d", "causal-conv1d", "1.4.0"),
    "chunk_gated_delta_rule": ("fla", "fla-core", "0.6.0"),
    "gated_delta_rule_step": ("fla", "fla-core", "0.6.0"),
    "ssd_chunk_scan": ("mamba_ssm", "mamba-ssm", "2.2.0"),
    "ssd_step": ("mamba_ssm", "mamba-ssm", "2.2.0"),
    "causal_attention": ("sdpa", None, None),
    "block_sparse_causal_attention": ("flex_attention", None, None),
    "gated_rms_norm": ("mamba_ssm", "mamba-ssm", "2.2.0"),
}
FORWARD_ONLY = ("causal_conv1d_step", "gated_delta_rule_step", "ssd_step")  # decode kernels: no backward
# distribution -> its top-level module (whose __version__ counts where a source tree has no metadata)
DISTRIBUTIONS = {"triton": "triton", "fla-core": "fla", "flash-linear-attention": "fla", "mamba-ssm": "mamba_ssm",
                 "causal-conv1d": "causal_conv1d", "tilelang": "tilelang"}
PROBE_TOLERANCE = 5e-2  # relative to the largest reference value; bf16 kernels measured 0.2-0.7% (docs/gpu.md)


def _version_tuple(version: str) -> Tuple[int, ...]:
    """'3.7.1+git1' -> (3, 7, 1): the leading numeric fields."""
    fields = []
    for part in version.split("+")[0].split("."):
        digits = "".join(c for c in part if c.isdigit()) if part[:1].isdigit() else ""
        if not digits:
            break
        fields.append(int(digits))
    return tuple(fields)


@dataclass(frozen=True)
class KernelEnvironment:
    """What kernel selection looks at: CUDA, the GPU's compute capability, installed versions, nvcc
    and whether torch.compile runs (FlexAttention needs it)."""

    cuda: bool
    capability: Optional[Tuple[int, int]] = None
    versions: Tuple[Tuple[str, str], ...] = ()  # (distribution, version) of the installed ones
    nvcc: bool = False
    compile: bool = True  # False under TORCHDYNAMO_DISABLE=1

    @classmethod
    def detect(cls) -> "KernelEnvironment":
        """This machine (package versions only where there is CUDA: without it nothing else matters)."""
        if not torch.cuda.is_available():
            return cls(cuda=False)
        versions = tuple((dist, v) for dist, v in ((d, _installed_version(d)) for d in DISTRIBUTIONS) if v)
        return cls(True, torch.cuda.get_device_capability(), versions, shutil.which("nvcc") is not None,
                   compile=compile_enabled())

    def version(self, dist: str) -> Optional[str]:
        """The installed version of a distribution, or None. fla ships as fla-core from 0.6 on and
        as flash-linear-attention before."""
        found = dict(self.versions)
        if dist == "fla-core" and dist not in found:
            return found.get("flash-linear-attention")
        return found.get(dist)


def compile_enabled() -> bool:
    """Whether torch.compile compiles: torch reads $TORCHDYNAMO_DISABLE when ``torch.compile`` is called
    (returning the function uncompiled), and $TORCH_COMPILE_DISABLE into ``torch._dynamo.config.disable``."""
    from torch._dynamo import config as dynamo_config

    return not (dynamo_config.disable or os.environ.get("TORCHDYNAMO_DISABLE", "") == "1")


def _installed_version(dist: str) -> Optional[str]:
    """The version in the distribution's metadata, else its module's __version__ (a source tree on
    PYTHONPATH, as mamba-ssm's Triton ops are brought to a machine without a CUDA build), else None."""
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        pass
    try:
        return getattr(importlib.import_module(DISTRIBUTIONS[dist]), "__version__", None)
    except Exception:  # not there, or a broken build: not installed as far as selection goes
        return None


def _fla_hopper_backward(env: KernelEnvironment) -> Optional[str]:
    """fla issue 640: on Hopper, Triton >= 3.4.0 and < 3.7.1 compiles the gated delta rule backward
    (chunk_bwd_dqkwg) wrongly. fla >= 0.5 then refuses unless tilelang (which needs nvcc) takes it;
    older fla computes wrong gradients without a word."""
    triton = env.version("triton")
    if env.capability is None or env.capability[0] != 9 or triton is None:
        return None
    if not (3, 4, 0) <= _version_tuple(triton) < (3, 7, 1):
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


# op -> conditions under which its kernel refuses or mis-computes: (env -> reason or None, whether
# only its backward is affected: then the kernel still runs where no gradient is needed)
KNOWN_ISSUES: Dict[str, Tuple[Tuple[Callable[[KernelEnvironment], Optional[str]], bool], ...]] = {
    "chunk_gated_delta_rule": ((_fla_hopper_backward, True),),
    "block_sparse_causal_attention": ((_flex_without_compile, False),),
}


def refusal(op: str, env: KernelEnvironment, backward: bool = True) -> Optional[str]:
    """Why the CUDA kernel of ``op`` must not run in ``env`` (None: it may, subject to ``probe``);
    ``backward=False``: why it must not run even where no gradient is needed (inference)."""
    if not env.cuda:
        return "CUDA is not available"
    _, dist, minimum = IMPLEMENTATIONS[op]
    if dist is not None:
        version = env.version(dist)
        if version is None:
            return f"{dist} is not installed (pip install '{dist}>={minimum}')"
        if _version_tuple(version) < _version_tuple(minimum):
            return f"{dist} {version} is older than {minimum}, the oldest version this project supports"
    for issue, backward_only in KNOWN_ISSUES.get(op, ()):
        reason = issue(env) if backward or not backward_only else None
        if reason:
            return reason
    return None


def example_inputs(op: str, device="cpu", dtype=torch.float32, seed: int = 0, *, b=1, s=128, h=2, d=64) -> tuple:
    """Positional arguments of ``op`` at valid values: [b, s, h, d] layouts, L2-normalised GDN keys,
    log decays <= 0, beta in (0, 1), dt > 0, A < 0, and an initial state."""
    g = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=g)

    q, k = (F.normalize(rand(b, s, h, d), dim=-1) for _ in range(2))  # [b, s, h, d]
    v, state = rand(b, s, h, d), rand(b, h, d, d) * 0.1  # state [b, h, d_k, d_v]
    decay, beta = -rand(b, s, h).abs() * 0.1, rand(b, s, h).sigmoid()  # [b, s, h]
    dt, A, D = F.softplus(rand(b, s, h) - 2), -rand(h).exp(), rand(h)
    x, weight, conv_state = rand(b, s, h * d), rand(h * d, 4) * 0.5, rand(b, h * d, 3)  # conv channels h * d
    read = (torch.arange(s) // 32 % 3 == 0).expand(b, s)  # [b, s]: every third block of 32 reads
    args = {
        "causal_conv1d": (x, weight, None, conv_state),
        "causal_conv1d_step": (x[:, 0], conv_state, weight),
        "chunk_gated_delta_rule": (q, k, v, decay, beta, None, state, True, 64),
        "gated_delta_rule_step": (q[:, 0], k[:, 0], v[:, 0], decay[:, 0], beta[:, 0], state),
        "ssd_chunk_scan": (v, dt, A, k, q, D, state, True, 64),  # x=v, dt, A, B=k, C=q
        "ssd_step": (v[:, 0], dt[:, 0], A, k[:, 0], q[:, 0], state, D),
        "causal_attention": (q, k, v),
        "block_sparse_causal_attention": (q, k, v, read, 32),
        "gated_rms_norm": (v, rand(b, s, h, d), 1 + rand(h * d) * 0.1, 1e-5),
    }[op]
    args = tuple(a.to(device=device, dtype=dtype if a.is_floating_point() else a.dtype) if torch.is_tensor(a) else a
                 for a in args)
    if op == "block_sparse_causal_attention":  # the read pattern travels as one BlockReads
        *qkv, read, block = args
        return (*qkv, BlockReads(read, block))
    return args


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.detach().double(), want.detach().double()
    return float((got - want).abs().max() / want.abs().max().clamp_min(1e-6))


def compare(op: str, kernel: Callable, reference: Callable, device, dtype=torch.bfloat16,
            backward: bool = True) -> Dict[str, float]:
    """Relative errors of ``kernel`` (``dtype`` inputs on ``device``) against ``reference`` (fp32,
    same values, same device): every output, and (``backward``, for ops that have one) every input
    gradient of a random projection of the outputs. Keys: 'out0', 'out1', ..., 'grad0', ..."""
    inputs = example_inputs(op, device, dtype)
    tensors = [i for i, a in enumerate(inputs) if torch.is_tensor(a) and a.is_floating_point()]
    backward = backward and op not in FORWARD_ONLY

    def run(fn, cast):
        args = [a.detach().to(cast).requires_grad_(backward) if i in tensors else a for i, a in enumerate(inputs)]
        with torch.set_grad_enabled(backward):
            out = fn(*args)
        return args, [o for o in (out if isinstance(out, tuple) else (out,)) if o is not None]

    args, outs = run(kernel, dtype)
    ref_args, ref_outs = run(reference, torch.float32)
    errors = {f"out{i}": _relative_error(o, r) for i, (o, r) in enumerate(zip(outs, ref_outs))}
    if not backward:
        return errors
    g = torch.Generator().manual_seed(1)
    weights = [torch.randn(r.shape, generator=g).to(device) for r in ref_outs]
    for ys in (outs, ref_outs):
        sum((y.float() * w).sum() for y, w in zip(ys, weights)).backward()
    for n, i in enumerate(tensors):
        errors[f"grad{n}"] = _relative_error(args[i].grad, ref_args[i].grad)
    return errors


@functools.lru_cache(maxsize=None)
def probe(op: str, kernel: Callable, reference: Callable, device="cuda", backward: bool = True) -> Optional[str]:
    """Run ``kernel`` once on tiny inputs, forward and (``backward``) backward, against the torch op:
    None when every output and gradient agrees within PROBE_TOLERANCE, else why not (an exception
    counts)."""
    try:
        errors = compare(op, kernel, reference, device, backward=backward)
    except Exception as e:  # a kernel that refuses, or fails to compile
        return f"its one-time check raised {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    bad = {name: err for name, err in errors.items() if not err <= PROBE_TOLERANCE}
    if bad:
        worst = max(bad, key=bad.get)
        return (f"its one-time check differs from the torch op: {worst} relative error {bad[worst]:.3g} "
                f"> {PROBE_TOLERANCE}")
    return None
