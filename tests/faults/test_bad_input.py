"""Bad input gets one named error line before any work, and leaves nothing behind (docs/reliability.md).

Each case runs the CLI as its own process (tests/processes.py: forked from a server that imported torch and
megatron-core once) and asserts the exact error line, the exit code, that no
run directory / output directory / ``.tmp`` file is left, and (oryx-train) that no model was built.
"""

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.processes import run_cli
from tests.test_train import TINY_MODEL, TINY_TRAIN

BIN = Path(sys.executable).parent
ENV = {**os.environ, "TORCHDYNAMO_DISABLE": "1", "WANDB_MODE": "offline", "PYTHONWARNINGS": "ignore"}
ENV.pop("ORYX_DEBUG", None)


# torch's own warning, logged when megatron-core's import reaches torch.utils.cpp_extension on a CUDA build of
# torch without a GPU but with a CUDA toolkit (megatron/core/tensor_parallel/random.py imports it): not ours.
# torch's log format: "W1201 15:42:18.761000 22085 torch/utils/cpp_extension.py:140] <message>".
TORCH_NO_CUDA_RUNTIME = re.compile(r"W\d{4} \d\d:\d\d:\d\d\.\d+ \d+ torch/utils/cpp_extension\.py:\d+\] "
                                   r"No CUDA runtime is found, using CUDA_HOME='[^']*'")


def without_torch_warnings(stderr: str) -> str:
    """stderr less the lines that are exactly torch's known warning (TORCH_NO_CUDA_RUNTIME)."""
    return "".join(line for line in stderr.splitlines(keepends=True)
                   if not TORCH_NO_CUDA_RUNTIME.fullmatch(line.rstrip("\n")))


def run(args, cwd, timeout=120):
    start = time.perf_counter()
    out = run_cli(args, cwd=cwd, env=ENV, timeout=timeout)
    out.stderr = without_torch_warnings(out.stderr)
    return out, time.perf_counter() - start


def test_only_torchs_known_warning_is_dropped_from_stderr():
    torch_line = "W1201 15:42:18.761000 22085 torch/utils/cpp_extension.py:140] No CUDA runtime is found, " \
                 "using CUDA_HOME='/usr/local'\n"
    error = "oryx-train: error: config key 'x': bad\n"
    assert without_torch_warnings(torch_line + error) == error
    kept = [torch_line.replace("'\n", "' and more\n"), torch_line.replace("torch/utils", "oryx_megatron"),
            "No CUDA runtime is found, using CUDA_HOME='/usr/local'\n"]
    assert without_torch_warnings("".join(kept) + error) == "".join(kept) + error


def last_line(stderr: str) -> str:
    return stderr.rstrip("\n").split("\n")[-1]


# --- oryx-train ---------------------------------------------------------------------------------

def train(tmp_path, *overrides, data=None, corpus=None):
    data = data or [f"data.data_path=[{corpus['shards']}]"]
    return run([sys.executable, "-m", "oryx_megatron.cli.train", *TINY_MODEL, *TINY_TRAIN, *data, "train.train_iters=2",
                "checkpoint.dir=null", *overrides], cwd=tmp_path)


def assert_train_error(out, seconds, tmp_path, line):
    assert out.returncode == 2, out.stdout + out.stderr
    assert out.stderr.strip().splitlines() == [line], out.stderr  # one line: no traceback
    assert "parameters on this rank" not in out.stdout + out.stderr  # failed before a model was built
    assert seconds < 60  # imports alone take 5-20 s on 2 busy cores; building the model is the step it skips
    assert not (tmp_path / "runs").exists()  # Hydra's run dir of this invocation is removed


@pytest.fixture
def broken_copy(corpus, tmp_path):
    """A copy of the corpus dataset, to break."""
    dst = tmp_path / "data"
    shutil.copytree(corpus["shards"], dst)
    return dst


def test_train_missing_data_path(corpus, tmp_path):
    out, s = train(tmp_path, data=["data.data_path=[/nonexistent/data]"])
    assert_train_error(out, s, tmp_path, "oryx-train: error: config key 'data.data_path': cannot read manifest "
                                         "/nonexistent/data: No such file or directory")


def test_train_missing_shard_file(broken_copy, tmp_path):
    (broken_copy / "shard-000001.tar").unlink()
    out, s = train(tmp_path, data=[f"data.data_path=[{broken_copy}]"])
    assert_train_error(out, s, tmp_path, f"oryx-train: error: config key 'data.data_path': {broken_copy}: shard file "
                                         f"{broken_copy}/shard-000001.tar is missing (1 of 4 shards)")


def test_train_unreadable_manifest(broken_copy, tmp_path):
    (broken_copy / "manifest.json").write_text("{not json")
    out, s = train(tmp_path, data=[f"data.data_path=[{broken_copy}]"])
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert out.stderr.startswith(f"oryx-train: error: config key 'data.data_path': manifest {broken_copy}/manifest.json "
                                 "is not valid JSON")
    assert not (tmp_path / "runs").exists()


def test_train_vocab_smaller_than_the_data_tokenizer(corpus, tmp_path):
    out, s = train(tmp_path, "model.vocab_size=128", corpus=corpus)
    assert_train_error(out, s, tmp_path, "oryx-train: error: config key 'model.vocab_size': 128 is smaller than the "
                                         f"data's tokenizer vocab 257 ({corpus['shards']})")


def test_train_holdout_shards_leave_nothing_to_train_on(corpus, tmp_path):
    out, s = train(tmp_path, "data.holdout_shards=4", corpus=corpus)
    assert_train_error(out, s, tmp_path, "oryx-train: error: config key 'data.holdout_shards': 4 must be between 1 and 3 "
                                         f"({corpus['shards']} has 4 shards, one at least for training)")


def test_train_global_batch_not_divisible(corpus, tmp_path):
    out, s = train(tmp_path, "train.global_batch_size=7", corpus=corpus)
    assert_train_error(out, s, tmp_path, "oryx-train: error: config key 'train.global_batch_size': 7 is not a multiple "
                                         "of train.micro_batch_size=2")


def test_global_batch_against_the_data_parallel_size_of_the_launch(corpus, tmp_path, monkeypatch):
    from oryx_megatron.run_config import ConfigError
    from oryx_megatron.training.validation import validate_run
    from tests.test_train import run_config

    run = run_config(corpus, tmp_path)  # global 8, micro 2
    validate_run(run, world_size=4)
    with pytest.raises(ConfigError, match=r"^config key 'train.global_batch_size': 8 is not a multiple of "
                                          r"train.micro_batch_size=2 x data-parallel size 3$"):
        validate_run(run, world_size=3)
    monkeypatch.setenv("WORLD_SIZE", "3")  # torchrun's
    with pytest.raises(ConfigError, match="data-parallel size 3"):
        validate_run(run)


def test_recompute_granularity_is_checked_and_old_run_configs_migrate(corpus, tmp_path):
    from omegaconf import OmegaConf

    from oryx_megatron.inference.checkpoint import migrate_run_config
    from oryx_megatron.run_config import ConfigError
    from oryx_megatron.training.validation import validate_run
    from tests.test_train import run_config

    run = run_config(corpus, tmp_path)
    run.train.recompute_granularity = "layers"
    with pytest.raises(ConfigError, match=r"^config key 'train.recompute_granularity': 'layers' is not one of "
                                          r"\(None, 'selective', 'full'\)$"):
        validate_run(run, world_size=1)
    for old, new in ((True, "full"), (False, None)):  # run_config.yaml of a checkpoint written before the rename
        cfg = migrate_run_config(OmegaConf.create({"train": {"recompute_activations": old, "seed": 3}}))
        assert OmegaConf.to_container(cfg) == {"train": {"recompute_granularity": new, "seed": 3}}


def test_train_missing_indexed_dataset(corpus, tmp_path):
    out, s = train(tmp_path, data=["data.format=indexed", "data.data_path=[/nonexistent/idx]", "data.eod_id=256"])
    assert_train_error(out, s, tmp_path, "oryx-train: error: config key 'data.data_path': /nonexistent/idx.bin: "
                                         "no such file")


def test_train_error_keeps_an_existing_run_dir(tmp_path):
    existing = tmp_path / "old_run"
    (existing / "checkpoints").mkdir(parents=True)
    out, _ = train(tmp_path, f"hydra.run.dir={existing}", data=["data.data_path=[/nonexistent/data]"])
    assert out.returncode == 2
    assert (existing / "checkpoints").is_dir()  # a directory with anything but Hydra's files stays


def test_train_debug_flag_shows_the_traceback(tmp_path):
    global ENV
    env = ENV
    ENV = {**env, "ORYX_DEBUG": "1"}
    try:
        out, _ = train(tmp_path, data=["data.data_path=[/nonexistent/data]"])
    finally:
        ENV = env
    assert out.returncode != 0 and "Traceback" in out.stderr and "cannot read manifest" in out.stderr


# --- oryx-eval and oryx-generate ----------------------------------------------------------------

def test_eval_bad_checkpoint_path(tmp_path):
    out, _ = run([BIN / "oryx-eval", tmp_path / "nope", "--task", "ppl", "--out", tmp_path / "eval"], cwd=tmp_path)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert last_line(out.stderr) == f"oryx-eval: error: checkpoint {tmp_path / 'nope'}: no such directory"
    assert not (tmp_path / "eval").exists()


def test_eval_checkpoint_dir_without_a_checkpoint(tmp_path):
    (tmp_path / "empty").mkdir()
    out, _ = run([BIN / "oryx-eval", tmp_path / "empty", "--task", "ppl", "--out", tmp_path / "eval"], cwd=tmp_path)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert last_line(out.stderr).startswith(f"oryx-eval: error: checkpoint {tmp_path / 'empty'} is neither a checkpoint")
    assert not (tmp_path / "eval").exists()


def test_eval_bad_task(tmp_path):
    out, _ = run([BIN / "oryx-eval", tmp_path, "--task", "pplx"], cwd=tmp_path)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert last_line(out.stderr) == ("oryx-eval: error: argument --task: invalid choice: 'pplx' "
                                     "(choose from 'ppl', 'mode_switch', 'mqar', 'niah')")


def test_generate_bad_schedule(tiny_checkpoint, tmp_path):
    out, _ = run([BIN / "oryx-generate", tiny_checkpoint, "--prompt", "x", "--schedule", "prefill=bogus"],
                 cwd=tmp_path)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert last_line(out.stderr).startswith("oryx-generate: error: argument --schedule: ")


def test_generate_tokenizer_larger_than_the_model(tiny_checkpoint, tmp_path):
    from oryx_megatron.data_prep.inputs import stdlib_files
    from oryx_megatron.data_prep.tokenizer import train_bpe

    tokenizer = train_bpe((f.read_text(errors="replace") for f in stdlib_files()[:20]), 300, tmp_path / "tok.json")
    assert tokenizer.vocab_size > 257
    out, _ = run([BIN / "oryx-generate", tiny_checkpoint, "--prompt", "def f(", "--tokenizer", tmp_path / "tok.json",
                  "--device", "cpu"], cwd=tmp_path)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert last_line(out.stderr) == (f"oryx-generate: error: the tokenizer's vocab ({tokenizer.vocab_size}) is larger "
                                     f"than the model's model.vocab_size=257 ({tiny_checkpoint})")


def test_generate_prompt_longer_than_the_model(tiny_checkpoint, tmp_path):
    out, _ = run([BIN / "oryx-generate", tiny_checkpoint, "--prompt", "x" * 70, "--max-new-tokens", "8",
                  "--device", "cpu"], cwd=tmp_path)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert last_line(out.stderr) == ("oryx-generate: error: prompt 0: 70 tokens + --max-new-tokens 8 = 78 exceeds "
                                     "the model's max_sequence_length 64")


def test_schedule_prompts_checks_the_length():
    import torch

    from oryx_megatron.inference.generation import schedule_prompts

    with pytest.raises(ValueError, match="a prompt of 60 tokens \\+ max_new_tokens 8 = 68 exceeds max_sequence_length 64"):
        schedule_prompts([[1] * 60], "all_attention", 8, 257, torch.device("cpu"), max_length=64)
    schedule_prompts([[1] * 56], "all_attention", 8, 257, torch.device("cpu"), max_length=64)


# --- oryx-prep ----------------------------------------------------------------------------------

def prep(tmp_path, *args):
    return run([BIN / "oryx-prep", "tokenize", *args, "--out", tmp_path / "out", "--workers", "1"], cwd=tmp_path)[0]


def assert_prep_error(out, tmp_path, line):
    assert out.returncode == 2, out.stdout + out.stderr
    assert "Traceback" not in out.stderr
    assert last_line(out.stderr) == line  # on a line of its own, not after the progress bar
    assert not (tmp_path / "out").exists()
    assert not list(tmp_path.rglob("*.tmp"))


def test_prep_binary_input(tmp_path):
    (tmp_path / "blob.bin").write_bytes(b"\x7fELF\x02\x01\x01\x00" + bytes(range(256)) * 8)
    out = prep(tmp_path, tmp_path / "blob.bin", "--tokenizer", "byte")
    assert_prep_error(out, tmp_path, f"oryx-prep: error: {tmp_path / 'blob.bin'} looks binary (a NUL byte at offset 7); "
                                     "pass --allow-binary to tokenize it anyway")


def test_prep_mostly_control_bytes_input(tmp_path):
    (tmp_path / "noise.txt").write_bytes(bytes(range(1, 9)) * 64)
    out = prep(tmp_path, tmp_path / "noise.txt", "--tokenizer", "byte")
    assert_prep_error(out, tmp_path, f"oryx-prep: error: {tmp_path / 'noise.txt'} looks binary (512 of its first 512 "
                                     "bytes are control bytes); pass --allow-binary to tokenize it anyway")
    assert prep(tmp_path, tmp_path / "noise.txt", "--tokenizer", "byte", "--allow-binary").returncode == 0


def test_prep_legacy_encoded_text_is_not_binary(tmp_path):
    # the stdlib (make demo) holds such files, e.g. test/encoded_modules/module_koi8_r.py
    (tmp_path / "koi8.txt").write_bytes("Привет, мир! Это текст в кодировке KOI8-R.\n".encode("koi8_r") * 8)
    out = prep(tmp_path, tmp_path / "koi8.txt", "--tokenizer", "byte")
    assert out.returncode == 0, out.stderr  # decoded by the --invalid-utf8 policy (replace)


def test_prep_empty_result_when_training_the_tokenizer(tmp_path):
    (tmp_path / "latin1.txt").write_bytes("caf\xe9 au lait".encode("latin-1"))
    out = prep(tmp_path, tmp_path / "latin1.txt", "--invalid-utf8", "skip", "--vocab-size", "512")
    assert_prep_error(out, tmp_path, "oryx-prep: error: the 1 input files hold no documents to train a tokenizer on "
                                     "(skipped: invalid_utf8 1)")


def test_prep_empty_result_with_a_given_tokenizer(tmp_path):
    (tmp_path / "latin1.txt").write_bytes("caf\xe9 au lait".encode("latin-1"))
    (tmp_path / "blank.txt").write_text("  \n")
    out = prep(tmp_path, tmp_path / "latin1.txt", tmp_path / "blank.txt", "--invalid-utf8", "skip", "--tokenizer", "byte")
    assert_prep_error(out, tmp_path, "oryx-prep: error: the 2 input files hold no documents to tokenize (0 documents, "
                                     "0 tokens; skipped: empty 1, invalid_utf8 1)")


@pytest.mark.parametrize("workers", ["1", "2"])
def test_prep_broken_jsonl_line(tmp_path, workers):
    (tmp_path / "good.jsonl").write_text("".join(f'{{"text": "document {i}"}}\n' for i in range(50)))
    (tmp_path / "bad.jsonl").write_text('{"text": "fine"}\n{"text": broken\n')
    out = run([BIN / "oryx-prep", "tokenize", tmp_path / "good.jsonl", tmp_path / "bad.jsonl", "--tokenizer", "byte",
               "--shard-size", "200", "--out", tmp_path / "out", "--workers", workers], cwd=tmp_path)[0]
    assert_prep_error(out, tmp_path, f"oryx-prep: error: {tmp_path / 'bad.jsonl'} (byte 17): invalid JSON: "
                                     "Expecting value: line 1 column 10 (char 9)")
