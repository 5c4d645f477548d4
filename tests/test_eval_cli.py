"""oryx-eval and oryx-generate end to end on a tiny checkpoint trained here on byte-tokenized code."""

import csv
import json
import math
import os
import re
import subprocess
import sys

import pytest
import torch

import numpy as np

from oryx_megatron.eval.mode_switch import CSV_COLUMNS, mode_gap, position_losses, tokens_to_converge
from oryx_megatron.cli import evaluate, generate

BIN = os.path.dirname(sys.executable)
TASK_KEYS = {
    "ppl": {"schedule", "loss", "perplexity", "attention_fraction", "attention_reads", "loss_attention", "loss_linear"},
    "mode_switch": {"switch", "target", "loss_after_switch", "loss_target", "tokens_to_converge", "mode_gap"},
    "mqar": {"schedule", "accuracy", "token_accuracy", "attention_fraction", "attention_reads"},
    "niah": {"schedule", "accuracy", "token_accuracy", "attention_fraction", "attention_reads"},
}
FAST = ["--num-batches", "2", "--batch-size", "2", "--num-samples", "8"]


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint, one_thread):
    return tiny_checkpoint


def run_eval(checkpoint, tmp_path, task, *extra):
    assert evaluate.main([checkpoint, "--task", task, "--out", str(tmp_path), *FAST, *extra]) == 0
    result = json.loads((tmp_path / f"{task}.json").read_text())
    assert result["task"] == task and result["rows"]
    for row in result["rows"]:
        assert set(row) == TASK_KEYS[task]
    return result


def test_ppl(checkpoint, tmp_path):
    rows = {row["schedule"]: row for row in run_eval(checkpoint, tmp_path, "ppl", "--attention-last", "8")["rows"]}
    assert set(rows) == {"all_attention", "all_linear", "random_chunks", "linear_then_attention"}
    for row in rows.values():
        assert math.isfinite(row["loss"]) and 1 < row["perplexity"] < 257
    assert rows["all_attention"]["attention_fraction"] == 1 and rows["all_linear"]["attention_fraction"] == 0
    assert rows["linear_then_attention"]["attention_fraction"] == 8 / 64
    assert rows["all_linear"]["loss_attention"] is None


def test_mode_switch(checkpoint, tmp_path):
    result = run_eval(checkpoint, tmp_path, "mode_switch", "--switch-at", "32", "--smooth", "4")
    assert result["switch_at"] == 32
    with open(tmp_path / "mode_switch.csv") as f:
        table = list(csv.DictReader(f))
    assert tuple(table[0]) == CSV_COLUMNS and len(table) == 64
    assert all(math.isfinite(float(v)) for line in table for v in line.values())
    # before the switch the switched curves equal the single-mode curve of their first mode
    first = table[10]
    assert float(first["loss_attention_to_linear"]) == pytest.approx(float(first["loss_all_attention"]), rel=1e-4)
    assert float(first["loss_linear_to_attention"]) == pytest.approx(float(first["loss_all_linear"]), rel=1e-4)
    assert (tmp_path / "mode_switch.png").stat().st_size > 1000
    for row in result["rows"]:
        assert row["tokens_to_converge"] is None or 0 <= row["tokens_to_converge"] < 32


def test_tokens_to_converge_definition():
    target = torch.full((20,), 2.0).numpy()
    switched = target.copy()
    switched[10:14] = 3.0  # positions 10..13 far off, then equal
    assert tokens_to_converge(switched, target, 10, 1, 0.1) == 4  # tolerance in nats
    assert tokens_to_converge(switched, target, 10, 2, 0.1) == 5  # the mean over (13, 14) is still off
    assert tokens_to_converge(switched, target, 10, 1, 1.0) == 0
    assert tokens_to_converge(target, target, 10, 4, 0.1) == 0
    assert tokens_to_converge(target + 1, target, 10, 4, 0.1) is None


def test_answers_only_scores_the_masked_positions_and_converges_over_them():
    losses = torch.tensor([[5.0, 1.0, 7.0, 2.0], [9.0, 3.0, 8.0, 4.0]])
    mask = torch.tensor([[0.0, 1.0, 0.0, 1.0], [0.0, 1.0, 0.0, 0.0]])
    curve = position_losses(losses, mask)  # answers at 1 (both windows) and 3 (the first)
    assert np.isnan(curve[[0, 2]]).all() and curve[1] == 2.0 and curve[3] == 2.0
    assert position_losses(losses, None).tolist() == [7.0, 2.0, 7.5, 3.0]
    target = np.array([np.nan, 0.1, np.nan, 0.1, np.nan, 0.1, np.nan])
    switched = np.array([np.nan, 0.9, np.nan, 0.5, np.nan, 0.1, np.nan])
    assert tokens_to_converge(switched, target, 1, 1, 0.2) == 3  # off at the answers 1 and 3, within at 5
    switched[5] = 0.4  # off at the last answer: never within
    assert tokens_to_converge(switched, target, 1, 1, 0.2) is None
    curves = {"all_attention": target, "all_linear": np.array([np.nan, 2.1, np.nan, 2.1, np.nan, 2.1, np.nan])}
    assert mode_gap(curves, 1) == pytest.approx(2.0)


@pytest.mark.parametrize("task", ["mqar", "niah"])
def test_retrieval(checkpoint, tmp_path, task):
    extra = ["--num-pairs", "4"] if task == "mqar" else []
    result = run_eval(checkpoint, tmp_path, task, *extra)
    rows = {row["schedule"]: row for row in result["rows"]}
    assert set(rows) == {"all_attention", "all_linear", "mixed"}
    for row in rows.values():
        assert 0 <= row["accuracy"] <= row["token_accuracy"] <= 1
    attention_tokens = 2 * 4 - 1 if task == "mqar" else 2 + 4  # 2 Q - 1; key_len + value_len
    assert rows["mixed"]["attention_fraction"] == attention_tokens / 64
    assert result["mixed_schedule"] == f"linear_then_attention n_last={attention_tokens}"  # --schedule's text form
    if task == "niah":
        assert result["haystack"] == "heldout"


def test_mqar_with_scattered_queries(checkpoint, tmp_path):
    result = run_eval(checkpoint, tmp_path, "mqar", "--num-pairs", "4", "--query-spans", "2")
    rows = {row["schedule"]: row for row in result["rows"]}
    assert result["query_spans"] == 2 and result["mixed_schedule"].startswith("query_spans")
    assert rows["mixed"]["attention_fraction"] == 2 * 3 / 64  # each sample's 2 spans of 2 queries: k v k


def test_cli_subprocesses(checkpoint, tmp_path):
    """Both console scripts, run side by side."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen([f"{BIN}/oryx-eval", checkpoint, "--task", "mqar", "--out", str(tmp_path), *FAST],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env),
        subprocess.Popen([f"{BIN}/oryx-generate", checkpoint, "--prompt", "def ", "import os\n",
                          "--schedule", "prefill=linear decode=attention", "--max-new-tokens", "6",
                          "--temperature", "0.8", "--top-k", "20"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env),
    ]
    (eval_out, eval_err), (gen_out, gen_err) = (p.communicate(timeout=120) for p in procs)
    assert procs[0].returncode == 0, eval_err
    assert "mixed" in eval_out and (tmp_path / "mqar.json").exists()
    assert procs[1].returncode == 0, gen_err
    assert gen_out.count("=== [") == 2
    for key in ("tokens fed in attention mode", "tokens fed in linear mode", "attention-token fraction",
                "prefill tokens/s", "decode tokens/s", "cache kv bytes", "cache recurrent bytes"):
        assert key in gen_out


def test_generate_in_process(checkpoint, capsys):
    assert generate.main([checkpoint, "--prompt", "class ", "--schedule", "linear:0-3,attention:3-",
                          "--max-new-tokens", "4", "--stop", "\n"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("=== [0]") and "schedule: linear:0-3,attention:3-" in out


def test_the_transformer_baseline_generates_with_its_cache(transformer_checkpoint, capsys):
    """oryx-generate on a Transformer checkpoint decodes through megatron's KV cache (no recurrent state); a
    schedule that reads linear, or --speculative, is refused in one line."""
    common = [transformer_checkpoint, "--prompt", "def ", "class ", "--max-new-tokens", "4", "--device", "cpu"]
    assert generate.main(common) == 0
    out = capsys.readouterr().out
    stats = dict(re.split(r"\s{2,}", line, maxsplit=1) for line in out.split("=== stats\n")[1].splitlines())
    assert out.count("=== [") == 2 and stats["tokens fed in linear mode"] == stats["cache recurrent bytes"] == "0"
    assert int(stats["cache kv bytes"].replace(",", "")) > 0
    for extra, line in (
            (["--schedule", "all_linear"], "oryx-generate: error: the Transformer baseline reads attention only: "
                                           "schedule 'all_linear' makes position 0 of prompt 0 read linear; use an "
                                           "attention-only schedule such as all_attention"),
            (["--speculative", "2"], "oryx-generate: error: speculative decoding drafts in linear mode: the "
                                     "Transformer baseline reads attention only")):
        argv = common[:2] + common[3:] + extra  # one prompt
        with pytest.raises(SystemExit) as exit_info:
            generate.main(argv)
        assert exit_info.value.code == 2 and capsys.readouterr().err.splitlines() == [line]


@pytest.mark.parametrize("main, argv, expected", [
    (evaluate.main, ["{missing}", "--task", "ppl"], "checkpoint {missing}"),
    (evaluate.main, ["{ckpt}", "--task", "bleu"], "argument --task: invalid choice: 'bleu'"),
    (generate.main, ["{ckpt}", "--prompt", "x", "--schedule", "prefill=linear decode=sideways"],
     "argument --schedule: inference schedule 'prefill=linear decode=sideways'"),
    (generate.main, ["{ckpt}", "--prompt", "x", "--schedule", "all-attention"],
     "unknown schedule 'all-attention'; expected a schedule name (random_chunks, all_attention, all_linear, "),
    (generate.main, ["{ckpt}", "--prompt-file", "{missing}"], "--prompt-file {missing}"),
    (generate.main, ["{ckpt}", "--prompt", "x", "--stop", "ab"], "--stop 'ab' encodes to 2 tokens"),
])
def test_bad_input_names_it(checkpoint, tmp_path, capsys, main, argv, expected):
    paths = {"missing": str(tmp_path / "nowhere"), "ckpt": checkpoint}
    with pytest.raises(SystemExit) as exit_info:
        main([a.format(**paths) for a in argv])
    assert exit_info.value.code == 2
    assert expected.format(**paths) in capsys.readouterr().err


def test_results_can_go_to_wandb_offline(checkpoint, tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    run_eval(checkpoint, tmp_path, "ppl", "--wandb", "offline")
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and any(runs[0].glob("*.wandb"))


def test_inference_tools_default_to_the_gpu_in_bf16_where_there_is_one():
    import argparse

    from oryx_megatron.cli.common import add_model_arguments
    from oryx_megatron.inference.loading import default_device, default_dtype

    assert (default_dtype("cuda"), default_dtype("cuda:1"), default_dtype("cpu")) == ("bfloat16", "bfloat16", "float32")
    parser = argparse.ArgumentParser()
    add_model_arguments(parser)
    args = parser.parse_args(["ckpt"])
    assert (args.device, args.dtype) == (default_device(), None)  # dtype follows the device at load time
    assert default_device() == ("cuda" if torch.cuda.is_available() else "cpu")
