"""One error path for every console script (oryx_megatron/cli/errors.py): a bad config, argument, file or
checkpoint ends as one line ``PROG: error: ...`` naming it, exit code 2, wherever it is raised (argument
parsing, Hydra's composition, the library, inside ``pretrain``); ``--debug`` or HYDRA_FULL_ERROR=1 shows the
traceback instead. Per command: tests/faults/test_bad_input.py (oryx-train, oryx-eval, oryx-generate,
oryx-prep), tests/test_hf_checkpoints.py (oryx-export, oryx-import), tests/test_experiments.py
(oryx-experiment); here, what the error path adds."""

import os
import re
import shutil
import sys

import pytest
from hydra.errors import MissingConfigException

from oryx_megatron.cli import evaluate, experiment, export_hf, generate, import_hf, params, prep
from oryx_megatron.cli.errors import InputError, one_line
from tests.processes import run_cli
from tests.faults.test_bad_input import without_torch_warnings
from tests.test_train import TINY_MODEL, TINY_TRAIN

ENV = {**os.environ, "TORCHDYNAMO_DISABLE": "1", "WANDB_MODE": "offline", "PYTHONWARNINGS": "ignore"}
for name in ("ORYX_DEBUG", "HYDRA_FULL_ERROR"):
    ENV.pop(name, None)


def error_lines(main, argv, capsys):
    """The stderr lines of ``main(argv)``, which must exit with code 2."""
    with pytest.raises(SystemExit) as exit_info:
        main([str(a) for a in argv])
    assert exit_info.value.code == 2
    return capsys.readouterr().err.splitlines()


@pytest.mark.parametrize("main,argv,line", [
    (params.main, ["model=nope"], "oryx-params: error: In 'oryx_params': Could not find 'model/nope' (available: "
                                  "gdn_130m, "),
    (params.main, ["model.hidden_sise=64"], "oryx-params: error: Could not override 'model.hidden_sise': Key "
                                            "'hidden_sise' not in 'ModelArgs'"),
    (params.main, ["--model", "x"], "oryx-params: error: unrecognized argument --model (arguments are overrides "
                                    "such as model=oryx_tg_1_4b)"),
    (prep.main, ["tokenize", "x.txt", "--out", "o", "--shard-size", "0"],
     "oryx-prep: error: argument --shard-size: size must be positive: '0'"),
    (prep.main, ["inspect", "{tmp}/nowhere"], "oryx-prep: error: cannot read manifest {tmp}/nowhere"),
    (generate.main, ["{tmp}", "--prompt", "x", "--max-new-tokens", "0"],
     "oryx-generate: error: argument --max-new-tokens: must be >= 1, got 0"),
    (generate.main, ["{tmp}", "--prompt", "x", "--prefill-chunk", "0"],
     "oryx-generate: error: argument --prefill-chunk: 0 must be >= 1, without --speculative"),
    (evaluate.main, ["{tmp}", "--task", "ppl", "--context-parallel", "2"],
     "oryx-eval: error: argument --context-parallel: 2 must be >= 1 and the number of processes launched (1: "),
    (evaluate.main, ["{tmp}", "--task", "ppl", "--num-batches", "0"],
     "oryx-eval: error: argument --num-batches: must be >= 1, got 0"),
    (evaluate.main, ["{tmp}/nowhere"], "oryx-eval: error: the following arguments are required: --task"),
    (experiment.main, ["e2_lm", "--smoke", "--out", "{tmp}/out", "train.bogus=1"],
     "oryx-experiment: error: Could not override 'train.bogus'"),
    (export_hf.main, ["hf", "{tmp}"], "oryx-export: error: the following arguments are required: out_dir"),
    (import_hf.main, ["hf", "{tmp}", "{tmp}/ckpt", "--tp", "0"], "oryx-import: error: argument --tp: must be >= 1, "
                                                                 "got 0"),
])
def test_each_command_ends_a_bad_input_as_one_line(main, argv, line, tmp_path, capsys, single_process_parallel):
    lines = error_lines(main, [a.format(tmp=tmp_path) for a in argv], capsys)
    assert len(lines) == 1 and lines[0].startswith(line.format(tmp=tmp_path)), lines


@pytest.mark.parametrize("switch", ["--debug", "HYDRA_FULL_ERROR=1"])
def test_debugging_shows_the_error_itself(switch, tmp_path, monkeypatch, capsys):
    argv = [str(tmp_path / "nowhere"), "--task", "ppl"]
    if switch == "--debug":
        argv.append(switch)
    else:
        monkeypatch.setenv(*switch.split("="))
    with pytest.raises(InputError, match="no such directory"):
        evaluate.main(argv)
    with pytest.raises(MissingConfigException):
        params.main(["model=nope", *argv[3:]])


def test_one_line_names_the_file_the_key_and_the_options():
    assert one_line(FileNotFoundError(2, "No such file or directory", "/x/y")) == "/x/y: No such file or directory"
    assert one_line(KeyError("data")) == "missing key 'data'"
    assert one_line(ValueError("first\n  second")) == "first"
    assert one_line(MissingConfigException("Could not find 'model/x'\n\nAvailable:\n\ta", "model/x", ["a", "b"])) == \
        "Could not find 'model/x' (available: a, b)"


def train(tmp_path, *overrides):
    out = run_cli([sys.executable, "-m", "oryx_megatron.cli.train", *TINY_MODEL, *TINY_TRAIN, *overrides,
                   f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path, env=ENV)
    return out.returncode, without_torch_warnings(out.stderr).splitlines()


def test_train_ends_hydras_errors_as_one_line(tmp_path):
    code, lines = train(tmp_path, "model=nope")
    assert code == 2 and len(lines) == 1 and lines[0].startswith(
        "oryx-train: error: In 'train': Could not find 'model/nope' (available: gdn_130m, "), lines
    code, lines = train(tmp_path, "train.micro_batch_sise=4")
    assert (code, lines) == (2, ["oryx-train: error: Could not override 'train.micro_batch_sise': Key "
                                 "'micro_batch_sise' not in 'TrainingConfig'"])


def test_train_ends_an_error_inside_pretrain_as_one_line(corpus, tiny_checkpoint, tmp_path):
    """A checkpoint of the non-distributed optimizer resumed with the distributed one: found while loading,
    inside ``pretrain``, after the model and optimizer are built."""
    ckpt = shutil.copytree(tiny_checkpoint, tmp_path / "ckpt")
    run = [f"data.data_path=[{corpus['shards']}]", f"checkpoint.dir={ckpt}", "train.train_iters=21",
           "optimizer.use_distributed_optimizer=true"]
    code, lines = train(tmp_path, *run)
    latest = (ckpt / "latest").read_text().strip()
    assert (code, lines) == (2, [f"oryx-train: error: config key 'optimizer.use_distributed_optimizer': true, but "
                                 f"checkpoint {ckpt / latest} holds a non-distributed optimizer's state: resume it "
                                 f"with false"])
    code, lines = train(tmp_path, *run, "--debug")
    assert code == 1 and "Traceback (most recent call last)" in "\n".join(lines)


@pytest.mark.parametrize("script", ["oryx_megatron.cli.generate", "oryx_megatron.cli.evaluate"])
def test_help_names_the_router_schedules_with_an_example_each(script):
    out = run_cli([sys.executable, "-m", script, "--help"])
    assert out.returncode == 0
    assert "router threshold=P" in out.stdout and "router budget=B [chunk_size=N]" in out.stdout
    assert re.search(r"threshold=0\.5", out.stdout) and re.search(r"budget=0\.1", out.stdout)
