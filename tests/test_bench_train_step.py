"""benchmarks/bench_train_step.py: the CPU toy run's table, its recomputation rows, argument errors (the FLOP
model it counts with: tests/test_flops.py)."""

import json
import os
import sys
from pathlib import Path

import pytest
import torch

from benchmarks.bench_train_step import COLUMNS, main, packed_documents
from tests.processes import run_cli

ROOT = Path(__file__).resolve().parents[1]


def test_cpu_toy_run_prints_every_family_and_the_baseline_ratio(tmp_path):
    out = tmp_path / "rows.json"
    command = [sys.executable, "benchmarks/bench_train_step.py", "--model-size", "tiny", "--seq", "256",
               "--micro-batch", "2", "--repeats", "2", "--json", str(out)]
    env = dict(os.environ, TORCHDYNAMO_DISABLE="1", WANDB_MODE="offline")
    result = run_cli(command, cwd=ROOT, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    header = lines.index(next(line for line in lines if line.startswith("model ")))
    table = [line.split() for line in lines[header + 2:]]
    assert all(len(cells) == len(COLUMNS) for cells in table), result.stdout
    models = [cells[0] for cells in table]
    assert models == ["transformer", "attn_only_oryx", "oryx_tm", "oryx_tm", "oryx_tg", "oryx_tg", "mamba2", "gdn"]
    assert all(cells[-1] == "ok" for cells in table), result.stdout
    ratio = [header for header, _, _ in COLUMNS].index("vs transformer")
    assert table[0][ratio] == "1.00"
    assert all(float(cells[ratio]) > 0 for cells in table)
    rows = json.loads(out.read_text())["rows"]
    assert [r["model"] for r in rows] == models and rows[0]["vs_transformer"] == 1.0
    on_cpu = not torch.cuda.is_available()
    assert all(r["flops"] > 0 and (r["peak_memory_gib"] is None) == on_cpu for r in rows)
    read = {r["model"]: r["attention_read"] for r in rows}  # the FLOP model's f
    assert (read["transformer"], read["attn_only_oryx"], read["mamba2"], read["gdn"]) == (1.0, 1.0, 0.0, 0.0)


def test_recomputation_rows_report_the_activations_they_save(tmp_path):
    """act GiB is measured on every device: selective keeps less than none, full less than both."""
    out = tmp_path / "rows.json"
    command = [sys.executable, "benchmarks/bench_train_step.py", "--families", "oryx_tg", "--p-attention", "0.5",
               "--seq", "128", "--chunk", "64", "--repeats", "1", "--recompute", "none", "selective", "full",
               "--json", str(out), "--profile", str(tmp_path / "profile")]
    env = dict(os.environ, TORCHDYNAMO_DISABLE="1", WANDB_MODE="offline")
    result = run_cli(command, cwd=ROOT, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    profiles = sorted(p.name for p in (tmp_path / "profile").iterdir())
    assert profiles == sorted(f"{m}-{r}.txt" for m in ("transformer", "oryx_tg-p0.5") for r in ("none", "selective", "full"))
    assert "aten::mm" in (tmp_path / "profile" / "oryx_tg-p0.5-selective.txt").read_text()
    act = {r["recompute"]: r["activation_gib"] for r in json.loads(out.read_text())["rows"] if r["model"] == "oryx_tg"}
    assert 0 < act["full"] < act["selective"] < act["none"]
    rows = [r for r in json.loads(out.read_text())["rows"] if r["recompute"] != "none"]
    assert all(-1 < r["act_vs_none"] < 0 for r in rows if r["model"] == "oryx_tg")


def test_unknown_model_size_names_the_value(capsys):
    with pytest.raises(SystemExit):
        main(["--model-size", "7b"])
    assert "--model-size: invalid choice: '7b'" in capsys.readouterr().err


def test_packed_documents_are_a_heavy_tailed_mix_around_an_eighth_of_the_sample():
    docs = packed_documents(64, 2048, seed=0)
    assert docs.shape == (64, 2048) and (docs[:, 0] == 0).all()
    steps = docs[:, 1:] - docs[:, :-1]
    assert ((steps == 0) | (steps == 1)).all()  # ids count documents up from 0
    lengths = torch.cat([torch.bincount(row) for row in docs])[:-1].float()  # the last of each row is cut
    whole = torch.cat([torch.bincount(row)[1:-1] for row in docs]).float()  # neither cut at the start nor the end
    assert 180 < whole.median() < 360 and whole.max() > 4 * whole.median()  # median seq / 8 = 256, a long tail
    assert lengths.min() >= 1 and packed_documents(64, 2048, seed=0).equal(docs)
