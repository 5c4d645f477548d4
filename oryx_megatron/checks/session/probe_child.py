"""One kernel's probe in a process of its own (the GPU session starts one per op, under a time limit):
a kernel that segfaults or leaves a sticky CUDA error ends this process, not the session.

    python -m oryx_megatron.checks.session.probe_child OP --json PATH [--crash]

Writes {"forward": reason or null, "backward": reason or null, "errors": {direction: {name: error}},
"device": ...} to PATH: the reason why ``get_kernels`` must not use the kernel (a known condition of
``selection.refusal``, else what ``ops.probe.measure`` found), per direction, and the relative errors
measured in each direction the kernel ran (the backward's include the outputs). Without CUDA the
probe runs the wrappers on CPU tensors (the torch op): the CPU rehearsal. ``--crash`` kills this
process with SIGSEGV first (the rehearsal of a kernel that segfaults).
"""

import argparse
import json
import os
import signal
from pathlib import Path

import torch

from oryx_megatron import ops
from oryx_megatron.ops import selection
from oryx_megatron.ops import probe as probing


def verdicts(op: str) -> dict:
    env = selection.KernelEnvironment.detect()
    device = "cuda" if env.cuda else "cpu"
    found = {"device": device, "errors": {}}
    for direction in ("forward", "backward"):
        backward = direction == "backward"
        known = selection.refusal(op, env, backward=backward) if env.cuda else None
        if known:  # not run: no errors measured in this direction
            found[direction] = known
        else:
            found[direction], found["errors"][direction] = probing.measure(
                op, ops.OPS[op].cuda, ops.OPS[op].torch, device, backward)
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("op", choices=ops.cuda_ops())
    parser.add_argument("--json", type=Path, required=True)
    parser.add_argument("--crash", action="store_true", help="rehearsal: die by SIGSEGV before probing")
    args = parser.parse_args()
    if args.crash:
        os.kill(os.getpid(), signal.SIGSEGV)
    torch.manual_seed(0)
    args.json.write_text(json.dumps(verdicts(args.op)) + "\n")


if __name__ == "__main__":
    main()
