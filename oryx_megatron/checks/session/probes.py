"""The GPU session's kernel probes: once per session, before any stage, each kernel in a process of its
own under a time limit. What they found (a pass, a known refusal, a wrong result, an exception, a
process killed by a signal, a timeout) is written to a verdict file that every later stage reads
through ``$ORYX_KERNEL_PROBES`` (``ops.probe``): a kernel that crashed costs one probe, not the session.
Beside each op's verdict the file holds the errors its probe measured and the tolerance it was judged
by (``probe.tolerance``): a later checkout with another tolerance probes again.

causal-conv1d's CUDA kernels (C++, built on CPU for the lent machine, never run yet) are opt-in: unless
``with_causal_conv1d``, their ops are refused unprobed, so an installed wheel is never run."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional

from oryx_megatron import ops
from oryx_megatron.ops import probe as probing

OPT_IN = {  # op -> why it is refused unless opted in (drop an entry once its probe has passed on a GPU)
    op: "opt-in: causal-conv1d's CUDA kernels have not passed a probe on a GPU yet (--with-causal-conv1d)"
    for op in ("causal_conv1d", "causal_conv1d_step")
}
POLL_S = 0.2


def _refused(reason: str) -> dict:
    return {"forward": reason, "backward": reason, "errors": {}}


def outcome(code: Optional[int], json_path: Path, log_path: Path, limit_s: float) -> dict:
    """The verdicts of a finished (or killed) probe process: its own when it wrote them, else why not."""
    if code is None:
        return _refused(f"its probe process ran past {limit_s:.0f} s and was killed")
    if code < 0:
        return _refused(f"its probe process was killed by {signal.Signals(-code).name}")
    try:
        found = json.loads(json_path.read_text())
        return {"forward": found["forward"], "backward": found["backward"], "errors": found["errors"]}
    except (OSError, ValueError, KeyError):
        lines = log_path.read_text(errors="replace").strip().splitlines() if log_path.exists() else []
        return _refused(f"its probe process exited with code {code}: {lines[-1] if lines else 'no output'}")


def run_probes(work: Path, env: dict, limit_s: float, with_causal_conv1d: bool,
               crash: Optional[str] = None) -> Dict[str, dict]:
    """Probe every op at once (one process each, ``limit_s`` for all of them); write the verdict file
    ``work/kernel_probes.json``; return op -> {"forward", "backward", "errors", "tolerance", "exit",
    "seconds"}."""
    folder = work / "probes"
    folder.mkdir(parents=True, exist_ok=True)
    child_env = {k: v for k, v in env.items() if k != probing.PROBES_ENV_VAR}  # a probe never reads verdicts
    found: Dict[str, dict] = {}
    running = {}  # op -> (process, log file, start)
    for op in ops.cuda_ops():
        if op in OPT_IN and not with_causal_conv1d:
            found[op] = {**_refused(OPT_IN[op]), "exit": None, "seconds": 0.0}
            continue
        if limit_s <= 0:
            found[op] = {**_refused("not probed: the session's deadline is near"), "exit": None, "seconds": 0.0}
            continue
        argv = [sys.executable, "-m", "oryx_megatron.checks.session.probe_child", op,
                "--json", str(folder / f"{op}.json")] + (["--crash"] if op == crash else [])
        log = open(folder / f"{op}.log", "w")
        proc = subprocess.Popen(argv, env=child_env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        running[op] = (proc, log, time.perf_counter())
    deadline = time.perf_counter() + limit_s
    while running:
        for op, (proc, log, start) in list(running.items()):
            code = proc.poll()
            if code is None and time.perf_counter() < deadline:
                continue
            if code is None:  # past the limit: the whole process group, as a stage at its limit
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            log.close()
            del running[op]
            found[op] = {**outcome(code, folder / f"{op}.json", folder / f"{op}.log", limit_s),
                         "exit": code, "seconds": round(time.perf_counter() - start, 1)}
        time.sleep(POLL_S)
    found = {op: {**found[op], "tolerance": probing.tolerance(op)} for op in ops.cuda_ops()}  # the one each was judged by
    verdicts = {op: {key: found[op][key] for key in ("forward", "backward", "tolerance", "errors")} for op in ops.cuda_ops()}
    (work / "kernel_probes.json").write_text(json.dumps({"verdicts": verdicts}, indent=1) + "\n")
    return found


def refused(found: Dict[str, dict]) -> List[str]:
    """'op: reason' for every op refused in some direction (the session log's line)."""
    return [f"{op} ({'backward' if v['forward'] is None else 'both'}): {v['backward'] or v['forward']}"
            for op, v in found.items() if v["forward"] or v["backward"]]
