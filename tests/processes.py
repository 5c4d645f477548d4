"""Processes for tests, forked from one server that imported torch, megatron-core and the package once
(multiprocessing's forkserver, FORKSERVER) instead of new interpreters, which spend ~5 s each on those imports on
2 cores: the ranks of tests/distributed.py, and ``run_cli``, a command of this package with the same exit code,
stdout and stderr as ``subprocess.run(args, capture_output=True, text=True)``. Each process is still a fresh fork
(no state of the test's process or of other tests).

What a fork cannot see, and the tests that start real interpreters for it:

- the interpreter's start: imports and what they print (megatron-core's warnings on stderr: a command's error
  must still be its only line): tests/test_train.py (a misspelled key is exactly one line on stderr),
  tests/test_context_parallel_eval.py (a bad --context-parallel likewise), tests/test_wheel.py (the installed
  scripts, from another directory), tests/test_structure.py and tests/test_hf_checkpoints.py (what an import
  pulls in);
- torchrun's rendezvous and environment, ranks that are separate interpreters end to end, each with its own
  hash seed (forks share the server's: a rank that orders anything by hashing strings would go unseen):
  tests/test_layout_gradients.py (DP=2 and CP=2 training, bit for bit the forked ranks' run),
  tests/test_context_parallel_eval.py (oryx-eval at CP=2);
- the interpreter's exit: ``os._exit`` here runs the atexit handlers but skips thread joins and teardown (a
  writer thread or process that would keep a real run from exiting): the torchrun and wheel tests above, the
  SIGTERM/requeue test (tests/test_train.py), the chaos run (tests/faults/test_chaos.py), the SLURM scripts
  (tests/test_slurm.py), the GPU session's stages (tests/test_gpu_session.py), the CLI runs of
  tests/test_eval_cli.py;
- signals sent to a process group of its own (SIGTERM for requeue, SIGKILL mid-save): the same tests."""

import atexit
import multiprocessing as mp
import os
import runpy
import subprocess
import sys
import tempfile
import traceback
import warnings
from importlib.metadata import entry_points
from pathlib import Path
from typing import Dict, Optional, Sequence

# What every command and rank imports (not the command modules themselves: ``runpy`` runs those afresh as __main__).
PRELOAD = ["hydra", "megatron.core", "oryx_megatron.run_config", "oryx_megatron.training.loop",
           "oryx_megatron.inference.checkpoint", "oryx_megatron.cli.errors"]
FORKSERVER = mp.get_context("forkserver")
FORKSERVER.set_forkserver_preload(PRELOAD)


def enter(env: Dict[str, str], cwd: str) -> None:
    """A forked process takes the environment and directory of the test that started it, not the server's."""
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)


def _command(args: Sequence[str]):
    """(module or script path, function or None, argv[0], argv) of ``[python, -m, module, ...]``,
    ``[python, script.py, ...]`` or ``[.../oryx-x, ...]``."""
    if Path(args[0]).name.startswith("python"):
        if args[1] == "-m":
            return args[2], None, args[2], list(args[3:])
        return args[1], None, args[1], list(args[2:])
    script = Path(args[0]).name
    (point,) = entry_points(group="console_scripts", name=script)
    return point.module, point.attr, str(args[0]), list(args[1:])


def _child(args, cwd, env, out_path, err_path):
    module, function, argv0, argv = _command(args)
    enter(env, cwd)
    for fd, path in ((1, out_path), (2, err_path)):
        target = os.open(path, os.O_WRONLY)
        os.dup2(target, fd)
        os.close(target)
    if env.get("PYTHONWARNINGS"):
        warnings.simplefilter(env["PYTHONWARNINGS"])
    sys.argv = [argv0, *argv]
    code = 0
    try:
        if function is None and module.endswith(".py"):
            runpy.run_path(module, run_name="__main__")
        elif function is None:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        else:  # what a console script's wrapper does
            code = getattr(__import__(module, fromlist=[function]), function)()
    except SystemExit as e:
        code = e.code
    except BaseException:
        traceback.print_exc()
        code = 1
    if code is not None and not isinstance(code, int):
        print(code, file=sys.stderr)
        code = 1
    atexit._run_exitfuncs()  # as the interpreter's exit would
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code or 0)


def run_cli(args: Sequence, cwd=None, env: Optional[Dict[str, str]] = None, timeout: float = 300,
            check: bool = False) -> subprocess.CompletedProcess:
    """``subprocess.run([str(a) for a in args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout,
    check=check)`` for a ``python -m oryx_megatron...`` or installed ``oryx-*`` command."""
    args = [str(a) for a in args]
    with tempfile.TemporaryDirectory() as tmp:
        out, err = Path(tmp) / "stdout", Path(tmp) / "stderr"
        out.touch()
        err.touch()
        proc = FORKSERVER.Process(target=_child, args=(args, str(cwd or os.getcwd()), dict(env or os.environ),
                                                    str(out), str(err)))
        proc.start()
        proc.join(timeout)
        if proc.exitcode is None:
            proc.kill()
            proc.join()
            raise subprocess.TimeoutExpired(args, timeout, out.read_text(), err.read_text())
        done = subprocess.CompletedProcess(args, proc.exitcode, out.read_text(), err.read_text())
    if check:
        done.check_returncode()
    return done
