"""oryx-experiment: every experiment of recipes/experiment/ end to end in its smoke configuration
(tables and plots with the documented columns, runs shared between experiments), and its errors."""

import json
import logging
import re
from pathlib import Path

import pytest

from oryx_megatron.tools import experiment
from oryx_megatron.tools.experiment import load_experiment, main, markdown_table, overrides, pivot_table, summarize

EXPERIMENTS = {  # name: (row labels of one model, metrics, plot)
    "e1_retrieval": ({"all_attention", "all_linear", "mixed"}, ["accuracy", "token_accuracy", "attention_fraction"],
                     "accuracy.png"),
    "e2_lm": ({"all_attention", "all_linear", "random_chunks", "linear_then_attention"}, ["loss", "attention_fraction"],
              "loss.png"),
    "e3_mode_switch": ({"attention_to_linear", "linear_to_attention"},
                       ["tokens_to_converge", "loss_after_switch", "loss_target"], "mode_switch.png"),
    "a1_shared_query": ({"all_attention", "all_linear", "random_chunks", "linear_then_attention"},
                        ["loss", "attention_fraction"], "loss.png"),
    "a2_sequence_mixing": ({"all_attention", "all_linear", "mixed"}, ["accuracy", "token_accuracy", "attention_fraction"],
                           "accuracy.png"),
}
ON_MQAR = ("e1_retrieval", "a2_sequence_mixing")  # the others train on a tokenized corpus


def byte_corpus(corpus):
    """The test corpus (byte tokens) instead of the stdlib dataset of the LM experiments."""
    return [f"data.data_path=[{corpus['shards']}]", "model.vocab_size=257"]


def run_dirs(out: Path):
    return sorted(p.name for p in (out / "runs").iterdir())


@pytest.fixture(scope="module")
def smoke_out(tmp_path_factory):
    return tmp_path_factory.mktemp("experiments")


@pytest.mark.parametrize("name", list(EXPERIMENTS))  # in this order: E3 and A1 reuse E2's runs, A2 E1's
def test_smoke_experiment_writes_tables_and_plots(corpus, smoke_out, name):
    exp = load_experiment(name, smoke=True)
    before = run_dirs(smoke_out) if (smoke_out / "runs").exists() else []
    data = [] if name in ON_MQAR else byte_corpus(corpus)
    assert main([name, "--smoke", "--out", str(smoke_out), *data]) == 0

    labels, metrics, plot = EXPERIMENTS[name]
    assert exp.metrics == metrics
    out = smoke_out / name
    results = json.loads((out / "results.json").read_text())
    plan = {(v, m, s) for v in exp.variants for m in exp.models for s in exp.seeds}
    assert {(r["variant"], r["model"], r["seed"]) for r in results["rows"]} == plan
    assert len(exp.seeds) == 2 and all(row["seeds"] == 2 for row in results["summary"])
    assert {row["label"] for row in results["summary"]} == labels
    assert len(results["summary"]) == len(exp.variants) * len(exp.models) * len(labels)
    for row in results["summary"]:
        assert all(f"{m}_per_seed" in row and len(row[f"{m}_per_seed"]) == 2 for m in metrics)
    tables = [line for line in (out / "results.md").read_text().splitlines() if line.startswith("| variant")]
    row_labels = dict.fromkeys(row["label"] for row in results["summary"])  # in the order of the rows
    assert tables[0] == "| " + " | ".join(["variant", "model", *row_labels]) + " |"
    assert tables[1] == "| " + " | ".join(["variant", "model", "row", "params", "seeds", *metrics]) + " |"
    assert (out / plot).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    new = sorted(set(run_dirs(smoke_out)) - set(before))
    if name == "e3_mode_switch":  # E2's Oryx runs, evaluated anew
        assert new == []
    elif name in ("a1_shared_query", "a2_sequence_mixing"):  # only the ablated variant trains
        assert len(new) == len(exp.models) * len(exp.seeds)
        results = json.loads((out / "results.json").read_text())
        ablated = {r["run"] for r in results["rows"] if r["variant"] == list(exp.variants)[1]}
        assert set(new) == ablated
    else:
        assert len(new) == len(plan)


def test_e1_mixed_mode_reads_under_ten_percent_attention():
    exp = load_experiment("e1_retrieval")
    attention_tokens = 2 * exp.eval["num_queries"] - 1  # the query/answer span (mqar.mixed_mode_schedule)
    assert attention_tokens / exp.train["data"]["seq_length"] < 0.10


def test_a_finished_run_is_reused(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="oryx_megatron.experiment")
    args = ["e1_retrieval", "--smoke", "--seeds", "3", "--out", str(tmp_path), "train.train_iters=1"]
    assert main(args) == 0
    assert main(args) == 0
    assert caplog.text.count("reusing") == len(load_experiment("e1_retrieval").models)


def test_overrides_flatten_nested_config():
    tree = {"model": {"num_layers": 2, "shared_query": True}, "data": {"mode_schedule": {"chunk_size": 64}},
            "train": {"train_iters": None}, "x": {"names": ["a", "b"]}}
    assert overrides(tree) == ["model.num_layers=2", "model.shared_query=true", "data.mode_schedule.chunk_size=64",
                               "train.train_iters=null", 'x.names=["a", "b"]']


def test_summary_means_over_seeds_and_marks_missing_values():
    rows = [dict(variant="base", model="m", seed=s, params=10, switch="linear_to_attention", steps=v, loss=l)
            for s, v, l in [(1, 4, 2.0), (2, None, 3.0)]]
    summary = summarize(rows, ["loss", "steps"])
    assert summary[0]["loss"] == 2.5 and summary[0]["loss_std"] == 0.5 and summary[0]["steps"] is None
    table = markdown_table(summary, ["loss", "steps"])
    assert table.splitlines()[2] == "| base | m | linear_to_attention | 10 | 2 | 2.5000 ± 0.5000 | n/a (4, -) |"
    assert pivot_table(summary, "loss").splitlines() == [
        "| variant | model | linear_to_attention |", "|---|---|---|", "| base | m | 2.5000 ± 0.5000 |"]


@pytest.mark.parametrize(
    "argv,message",
    [
        (["e9_nothing"], r"unknown experiment 'e9_nothing'; recipes/experiment/ has a1_shared_query, .*e3_mode_switch"),
        (["e2_lm", "train.train_iters"], r"override 'train.train_iters' is not key=value"),
    ],
)
def test_bad_arguments_are_named(capsys, argv, message):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert re.search(message, capsys.readouterr().err)


def test_bad_experiment_file_names_the_field(tmp_path, monkeypatch):
    (tmp_path / "bad.yaml").write_text("name: bad\nclaim: c\nmodels: [tiny_gdn]\nseeds: [1]\nmetrics: [loss]\n"
                                       "eval: {task: ppl, num_windows: 3}\n")
    (tmp_path / "typo.yaml").write_text("name: typo\nclaim: c\nmodels: [tiny_gdn]\nseeds: [1]\nmetrics: [loss]\n"
                                        "eval: {task: ppl}\nvariant: {}\n")
    monkeypatch.setattr(experiment, "EXPERIMENTS_DIR", tmp_path)
    with pytest.raises(ValueError, match=r"bad.yaml: eval.num_windows is not an argument of ppl"):
        load_experiment("bad")
    with pytest.raises(ValueError, match=r"typo.yaml: .*variant"):
        load_experiment("typo")


def test_run_key_ignores_logging_and_follows_what_shapes_the_weights():
    base = ["data=mqar", "logging.wandb_mode=disabled"]
    key = experiment.run_key(experiment.compose_run("tiny_gdn", 1, base))
    same = ["train.log_interval=7", "train.eval_interval=null", "logging.wandb_mode=offline", "checkpoint.dir=/x"]
    assert experiment.run_key(experiment.compose_run("tiny_gdn", 1, base + same)) == key
    for other in (["optimizer.lr=1e-4"], ["data.mqar_num_pairs=4"], ["model.num_layers=1"]):
        assert experiment.run_key(experiment.compose_run("tiny_gdn", 1, base + other)) != key
    assert experiment.run_key(experiment.compose_run("tiny_gdn", 2, base)) != key
