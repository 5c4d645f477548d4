"""Which CUDA kernels may run here: the conditions an op declares (``KernelOp.requires``).

A kernel that would refuse or mis-compute is never chosen: ``refusal(op, env)`` names the reason
from the environment alone (no import, so conditions can be injected); ``probe.probe(op)`` then runs
the kernel once on the GPU and compares it with the torch op.
"""

import importlib
import importlib.metadata
import os
import shutil
from dataclasses import dataclass
from typing import Callable, Optional, Tuple

import torch

from .registry import OPS

# distribution -> its top-level module (whose __version__ counts where a source tree has no metadata); the
# distributions an op's ``Package`` names are looked up too
DISTRIBUTIONS = {"triton": "triton", "fla-core": "fla", "flash-linear-attention": "fla", "mamba-ssm": "mamba_ssm",
                 "causal-conv1d": "causal_conv1d", "tilelang": "tilelang"}


def version_tuple(version: str) -> Tuple[int, ...]:
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
        declared = {c.dist: c.module for op in OPS.values() for c in op.requires if isinstance(c, Package)}
        modules = {**declared, **DISTRIBUTIONS}
        versions = tuple((dist, v) for dist, v in ((d, _installed_version(d, m)) for d, m in modules.items()) if v)
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


def _installed_version(dist: str, module: Optional[str]) -> Optional[str]:
    """The version in the distribution's metadata, else its module's __version__ (a source tree on
    PYTHONPATH, as mamba-ssm's Triton ops are brought to a machine without a CUDA build), else None."""
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        pass
    if module is None:
        return None
    try:
        return getattr(importlib.import_module(module), "__version__", None)
    except Exception:  # not there, or a broken build: not installed as far as selection goes
        return None


@dataclass(frozen=True)
class Package:
    """A condition of ``KernelOp.requires``: the distribution that ships the kernel, at ``minimum`` or newer
    (``module``: its top-level module, whose __version__ counts where there is no metadata)."""

    dist: str
    minimum: str
    module: Optional[str] = None

    def reason(self, env: KernelEnvironment, backward: bool) -> Optional[str]:
        version = env.version(self.dist)
        if version is None:
            return f"{self.dist} is not installed (pip install '{self.dist}>={self.minimum}')"
        if version_tuple(version) < version_tuple(self.minimum):
            return f"{self.dist} {version} is older than {self.minimum}, the oldest version this project supports"
        return None


@dataclass(frozen=True)
class KnownIssue:
    """A condition of ``KernelOp.requires``: ``check(env)`` names where the kernel refuses or mis-computes
    (None: not here); ``backward_only``: only its backward, so it still runs where no gradient is needed."""

    check: Callable[[KernelEnvironment], Optional[str]]
    backward_only: bool = False

    def reason(self, env: KernelEnvironment, backward: bool) -> Optional[str]:
        return self.check(env) if backward or not self.backward_only else None


def refusal(op: str, env: KernelEnvironment, backward: bool = True) -> Optional[str]:
    """Why the CUDA kernel of ``op`` must not run in ``env`` (None: it may, subject to ``probe``);
    ``backward=False``: why it must not run even where no gradient is needed (inference)."""
    declared = OPS[op]
    if declared.cuda is None:
        return f"it has no CUDA kernel (none declared in {declared.torch.__module__})"
    if not env.cuda:
        return "CUDA is not available"
    for condition in declared.requires:
        reason = condition.reason(env, backward)
        if reason:
            return reason
    return None
