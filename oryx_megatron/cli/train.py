"""oryx-train: pretrain an Oryx (or baseline) language model on megatron-core.

    oryx-train recipe=oryx_tg_130m checkpoint.dir=/ckpt/run1 optimizer.lr=3e-3
    torchrun --nproc-per-node 8 -m oryx_megatron.cli.train recipe=oryx_tg_1_4b parallel.tensor_model_parallel_size=2
    oryx-train -m recipe=oryx_tg_130m optimizer.lr=1e-3,3e-3 hydra/launcher=slurm

A Hydra app over recipes/train.yaml (docs/training.md); the run itself is
``training.loop.pretrain``. ``--debug`` (or HYDRA_FULL_ERROR=1) shows an error's traceback.
"""

import os
import shutil
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import List, Optional

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from oryx_megatron import RECIPES_DIR
from oryx_megatron.cli.errors import DEBUG_FLAG, debugging, error_path
from oryx_megatron.launch import REQUEUE_EXIT_CODE, exit_for_requeue
from oryx_megatron.run_config import load_train_config
from oryx_megatron.training.loop import pretrain
from oryx_megatron.training.validation import validate_run

PROG = "oryx-train"


@hydra.main(config_path=str(RECIPES_DIR), config_name="train", version_base=None)
def train(cfg: DictConfig) -> None:
    """One job, through the error path: the run config, checked (``validate_run``: a bad key, value or dataset
    fails before any process group or model exists), then ``pretrain``, whose errors too end as one line. A bad
    input removes the run directory Hydra created for this job if it holds nothing else. Whether to show
    tracebacks is ``main``'s decision, recorded in ORYX_DEBUG (a launcher's job process inherits it)."""
    run_dir = HydraConfig.get().runtime.output_dir
    debug = os.environ.get("ORYX_DEBUG", "") not in ("", "0")
    with error_path(PROG, debug, cleanup=lambda: _remove_fresh_run_dir(run_dir)):
        run = load_train_config(cfg)
        validate_run(run)
        exit_code = pretrain(run, run.logging.output_dir or run_dir)
    if exit_code == REQUEUE_EXIT_CODE:
        exit_for_requeue()  # the checkpoint is complete on every rank


def main(argv: Optional[List[str]] = None) -> None:
    """``train`` through the error path. Hydra prints its own errors (a bad override, an unknown recipe) unless
    HYDRA_FULL_ERROR is set, then it raises them: set here, so that they reach the error path as one line.
    ``--debug`` is taken off the command line Hydra parses."""
    argv = sys.argv[1:] if argv is None else list(argv)
    debug = debugging(argv)
    sys.argv = [sys.argv[0], *(a for a in argv if a != DEBUG_FLAG)]
    with _environment(HYDRA_FULL_ERROR="1", ORYX_DEBUG="1" if debug else "0"), error_path(PROG, debug):
        train()


@contextmanager
def _environment(**values: str):
    """The environment variables ``values`` set inside, restored after."""
    previous = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in previous.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _remove_fresh_run_dir(run_dir: str) -> None:
    """Remove Hydra's run directory if it holds nothing but what Hydra wrote at start (``.hydra/``
    and the job log); a directory with anything else (checkpoints, metrics) is left alone."""
    path = Path(run_dir)
    if not path.is_dir() or any(f.name != ".hydra" and not (f.is_file() and f.suffix == ".log")
                                for f in path.iterdir()):
        return
    shutil.rmtree(path, ignore_errors=True)
    date, runs = path.parent, path.parent.parent  # the default runs/<date>/<time>: those folders too, if now empty
    if runs.name == "runs":
        for folder in (date, runs):
            if folder.is_dir() and not any(folder.iterdir()):
                folder.rmdir()


if __name__ == "__main__":
    # `python -m oryx_megatron.cli.train`: run the importable module's main, so that a submitit sweep
    # pickles its job function by reference (cloudpickle copies __main__'s functions and classes by value).
    from oryx_megatron.cli.train import main as importable_main

    importable_main()
