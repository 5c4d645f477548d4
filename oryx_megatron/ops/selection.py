"""Which CUDA kernels may run here: the known version and architecture conditions.

A kernel that would refuse or mis-compute is never chosen: ``refusal(op, env)`` names the reason
from the environment alone (no import, so conditions can be injected); ``probe.probe(op)`` then runs
the kernel once on the GPU and compares it with the torch op.
"""

import importlib
import importlib.metadata
import os
import shutil
from dataclasses import dataclass
from typing import Callable, Dict, Optional, Tuple

import torch

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
# distribution -> its top-level module (whose __version__ counts where a source tree has no metadata)
DISTRIBUTIONS = {"triton": "triton", "fla-core": "fla", "flash-linear-attention": "fla", "mamba-ssm": "mamba_ssm",
                 "causal-conv1d": "causal_conv1d", "tilelang": "tilelang"}


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

