"""oryx-experiment: every experiment of recipes/experiment/ end to end in its smoke configuration
(tables and plots with the documented columns, runs shared between experiments), the learning-rate
sweep (selection on the validation split only), and its errors."""

import json
import logging
import re
import subprocess
from pathlib import Path

from types import SimpleNamespace

import pytest
import torch

from oryx_megatron.data.synthetic import MQARLoader
from oryx_megatron.eval.retrieval import build_task
from oryx_megatron.eval.validation import validation_samples
from oryx_megatron.cli.experiment import main
from oryx_megatron.experiments import config, driver, runs
from oryx_megatron.experiments.config import load_experiment
from oryx_megatron.experiments.runs import choose_lr, overrides
from oryx_megatron.experiments.tables import markdown_table, pivot_table, summarize, sweep_table
from oryx_megatron.source import git_source, source_label

ROUTING = {"all_linear", "all_attention", "oracle", *(f"{kind}@{tag}" for kind in ("router", "random", "first", "last",
                                                                                  "entropy") for tag in ("0.1", "p0.5"))}
JOINT_ROUTING = (ROUTING | {f"joint:{label}" for label in ROUTING},
                 ["accuracy", "attention_fraction", "se"], "routing.png")
RETRIEVAL = ({"all_attention", "all_linear", "mixed"}, ["accuracy", "token_accuracy", "attention_fraction"],
             "accuracy.png")
EXPERIMENTS = {  # name: (row labels of one model, metrics, plot)
    "e1_retrieval": RETRIEVAL,
    "e2_lm": ({"all_attention", "all_linear", "random_chunks", "linear_then_attention"}, ["loss", "attention_fraction"],
              "loss.png"),
    "e3_mode_switch": ({"attention_to_linear", "linear_to_attention"},
                       ["tokens_to_converge", "loss_after_switch", "loss_target", "mode_gap"],
                       "mode_switch.png"),
    "a1_shared_query": ({"all_attention", "all_linear", "random_chunks", "linear_then_attention"},
                        ["loss", "attention_fraction"], "loss.png"),
    "a2_sequence_mixing": RETRIEVAL,
    "niah": RETRIEVAL,
    "routing_small": JOINT_ROUTING,
    "routing_scattered": JOINT_ROUTING,
    "routing_12pairs": JOINT_ROUTING,
    "e4_axes_small": (RETRIEVAL[0], [*RETRIEVAL[1], "attention_reads"], "accuracy.png"),
    "routing_lm": ({"all_linear", "all_attention", *(f"{kind}@0.2" for kind in ("router", "random", "first", "last",
                                                                              "entropy"))},
                   ["loss", "attention_fraction", "se"], "routing.png"),
}
ON_MQAR = ("e1_retrieval", "e3_mode_switch", "a2_sequence_mixing", "routing_small", "routing_scattered",
           "routing_12pairs", "e4_axes_small")
# evaluate runs of an earlier experiment (E1's, E2's; routing_12pairs's smoke runs and routers are routing_small's)
REUSING = ("e3_mode_switch", "niah", "routing_12pairs")
REUSING_BASE = ("routing_lm",)  # E2's runs, with routers of its own


def byte_corpus(corpus):
    """The test corpus (byte tokens) instead of the stdlib dataset of the LM experiments."""
    return [f"data.data_path=[{corpus['shards']}]", "model.vocab_size=257"]


def run_dirs(out: Path):
    return sorted(p.name for p in (out / "runs").iterdir())


def runs_per_variant_and_model(exp) -> int:
    """Sweep runs (each lr, each sweep seed) plus the seeds the sweep did not train."""
    if not exp.lrs:
        return len(exp.seeds)
    return len(exp.lrs) * len(exp.sweep_seeds) + len(set(exp.seeds) - set(exp.sweep_seeds))


@pytest.fixture(scope="module")
def smoke_out(tmp_path_factory):
    return tmp_path_factory.mktemp("experiments")


@pytest.mark.parametrize("name", list(EXPERIMENTS))  # in this order: E3 and A2 reuse E1's runs, A1 and NIAH E2's
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
    assert tables[1] == "| " + " | ".join(["variant", "model", "row", "params", "lr", "seeds", *metrics]) + " |"
    assert (out / plot).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    if exp.lrs:  # one sweep per (variant, model), its table in results.md; every seed tested at the chosen lr
        assert [(s["variant"], s["model"]) for s in results["sweeps"]] == [(v, m) for v in exp.variants
                                                                            for m in exp.models]
        chosen = {(s["variant"], s["model"]): s["lr"] for s in results["sweeps"]}
        assert all(r["lr"] == chosen[r["variant"], r["model"]] for r in results["rows"])
        assert "## Learning rate: validation loss" in (out / "results.md").read_text()
    if exp.model_lrs:  # every run at its model's given rate
        assert all(r["lr"] == exp.model_lrs[r["model"]] for r in results["rows"])
    if exp.match_params:  # matched parameter counts
        params = {row["model"]: row["params"] for row in results["summary"]}
        assert all(abs(n / params[exp.match_params] - 1) <= 0.02 for n in params.values()), params

    new = sorted(set(run_dirs(smoke_out)) - set(before))
    if name in REUSING:  # an earlier experiment's runs, evaluated anew
        assert new == []
    elif name in ("a1_shared_query", "a2_sequence_mixing"):  # only the ablated variant trains
        assert len(new) == len(exp.models) * runs_per_variant_and_model(exp)
        ablated = {r["run"] for r in results["rows"] if r["variant"] == list(exp.variants)[1]}
        assert ablated <= set(new)
    else:  # and a router fitted to every tested run, and a joint router trained on from it
        routers = len(exp.models) * len(exp.seeds) * ((exp.router is not None) + (exp.joint is not None))
        base = 0 if name in REUSING_BASE else len(exp.variants) * len(exp.models) * runs_per_variant_and_model(exp)
        assert len(new) == base + routers


def test_e1_mixed_mode_reads_under_ten_percent_attention():
    exp = load_experiment("e1_retrieval")
    attention_tokens = 2 * exp.eval["num_queries"] - 1  # the query/answer span (mqar.mixed_mode_schedule)
    assert attention_tokens / exp.train["data"]["seq_length"] < 0.10


def test_a_finished_run_is_reused(tmp_path, caplog, monkeypatch):
    """Runs are keyed by their config: a run trained by other code is reused too, with a warning naming both
    commits; results.json and results.md say which code trained each tested run (its checkpoint's ``source``)."""
    caplog.set_level(logging.INFO, logger="oryx_megatron.experiment")
    args = ["e1_retrieval", "--smoke", "--seeds", "3", "--out", str(tmp_path), "train.train_iters=1"]
    assert main(args) == 0  # seed 3 is the sweep's: its run at the chosen lr is reused
    exp = load_experiment("e1_retrieval", smoke=True)
    assert caplog.text.count("reusing") == len(exp.models) and "trained by the code at" not in caplog.text
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).parents[1], capture_output=True,
                          text=True, check=True).stdout.strip()
    here = source_label(git_source())
    assert git_source()["commit"] == head and here.startswith(head[:12])
    results = json.loads((tmp_path / "e1_retrieval/results.json").read_text())
    assert list(results["trained_by"].values()) == [here] * len(exp.models)
    assert f"Trained by the code at: {here} ({len(exp.models)} runs)" in \
        (tmp_path / "e1_retrieval/results.md").read_text()
    caplog.clear()
    monkeypatch.setattr(runs, "git_source", lambda: {"commit": "f" * 40, "uncommitted_changes": False})
    assert main(args) == 0  # every run reused, each trained by other code than this "checkout"'s
    reused = [r for r in caplog.records if r.getMessage().startswith("reusing")]
    assert len(reused) == len(exp.models) * (len(exp.lrs) + 1)
    assert all(r.levelname == "WARNING" and re.fullmatch(
        rf"reusing {tmp_path}/runs/\S+/checkpoints/iter_0000001, trained by the code at {re.escape(here)} \(this "
        rf"checkout: ffffffffffff\); remove {tmp_path}/runs/\S+ to train it again", r.getMessage()) for r in reused)


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
    assert table.splitlines()[2] == "| base | m | linear_to_attention | 10 | - | 2 | 2.5000 ± 0.5000 (2, 3) | n/a (4, -) |"
    assert pivot_table(summary, "loss").splitlines() == [
        "| variant | model | linear_to_attention |", "|---|---|---|", "| base | m | 2.5000 ± 0.5000 (2, 3) |"]


def test_tables_give_mean_std_and_every_seed():
    rows = [dict(variant="base", model="m", seed=s, params=10, lr=0.003, schedule="mixed", accuracy=a)
            for s, a in [(1, 0.014), (2, 1.0), (3, 0.5)]]
    summary = summarize(rows, ["accuracy"])
    assert markdown_table(summary, ["accuracy"]).splitlines()[2] == (
        "| base | m | mixed | 10 | 0.003 | 3 | 0.5047 ± 0.4025 (0.014, 1, 0.5) |")
    sweeps = [dict(variant="base", model="m", lr=0.001, validation_loss={"0.001": [1.5, 1.7], "0.003": [1.9, 2.1]})]
    assert sweep_table(sweeps).splitlines() == [
        "| variant | model | lr 0.001 | lr 0.003 | chosen lr |", "|---|---|---|---|---|",
        "| base | m | 1.6000 (1.5000, 1.7000) | 2.0000 (1.9000, 2.1000) | 0.001 |"]


def test_choose_lr_takes_the_lowest_mean_validation_loss_ties_to_the_smaller_lr():
    assert choose_lr({1e-3: [2.0, 2.2], 3e-3: [1.9, 2.1], 1e-2: [1.0, 9.0]}) == 3e-3
    assert choose_lr({1e-2: [1.0], 3e-3: [1.0], 1e-3: [1.5]}) == 3e-3
    assert choose_lr({1e-3: [3.0], 1e-2: [float("nan")], 3e-2: [float("inf")]}) == 1e-3  # diverged runs lose
    with pytest.raises(ValueError, match="no learning rates"):
        choose_lr({})


VALIDATION = {1e-3: 2.0, 3e-3: 1.5}  # validation loss per lr of the fake runs


def fake_runs(monkeypatch, test_accuracy):
    """No training: runs know their lr, validation losses come from VALIDATION, test accuracy from
    ``test_accuracy(lr)``. Returns the arguments choose_lr received."""
    def train_and_load(model, seed, config, out):
        lr = float([o for o in config if o.startswith("optimizer.lr=")][-1].split("=")[1])
        return torch.nn.Linear(2, 2), SimpleNamespace(optimizer=SimpleNamespace(lr=lr)), f"{model}-s{seed}-{lr}"

    def evaluate(exp, net, run, out, joint=False):
        return {"rows": [dict(schedule="mixed", accuracy=test_accuracy(run.optimizer.lr), token_accuracy=0.5,
                              attention_fraction=0.1)]}

    seen = []
    monkeypatch.setattr(driver, "train_and_load", train_and_load)
    monkeypatch.setattr(driver, "trained_by", lambda checkpoint: "no code: a fake run")
    monkeypatch.setattr(driver, "validation_loss", lambda net, run, *args: VALIDATION[run.optimizer.lr])
    monkeypatch.setattr(driver, "evaluate", evaluate)
    monkeypatch.setattr(driver, "choose_lr", lambda losses: seen.append(losses) or choose_lr(losses))
    return seen


@pytest.mark.parametrize("test_accuracy", [lambda lr: lr, lambda lr: -lr])
def test_the_sweep_selects_on_validation_loss_only(tmp_path, monkeypatch, test_accuracy):
    seen = fake_runs(monkeypatch, test_accuracy)
    exp = load_experiment("e1_retrieval", smoke=True)
    exp.match_params = None
    results = driver.run_experiment(exp, tmp_path, [])
    assert seen == [{lr: [loss] for lr, loss in VALIDATION.items()}] * len(exp.models)  # validation numbers only
    assert {s["lr"] for s in results["sweeps"]} == {3e-3} == {r["lr"] for r in results["rows"]}
    assert {r["accuracy"] for r in results["rows"]} == {test_accuracy(3e-3)}


def test_validation_and_test_sets_differ_from_training():
    exp = load_experiment("e1_retrieval", smoke=True)
    assert exp.validation.seed not in exp.seeds + exp.sweep_seeds and exp.validation.seed != exp.eval["seed"]
    run = runs.compose_run(exp.models[0], exp.seeds[0], runs.run_overrides(exp))
    d, n = run.data, 64
    rows = lambda inputs: {tuple(row) for row in inputs}
    validation = rows(validation_samples(run, exp.validation.seed, n)["inputs"])
    test = rows(build_task("mqar", run, n, d.seq_length, exp.eval["seed"], "random", d.mqar_num_pairs,
                           d.mqar_num_queries, 1, 1, 1)[0]["inputs"])
    loaders = [MQARLoader(seq_len=d.seq_length, micro_batch_size=1, vocab_size=run.model.vocab_size,
                          num_pairs=d.mqar_num_pairs, filler_id=d.mqar_filler_id, seed=seed)
               for seed in exp.seeds + exp.sweep_seeds]
    training = rows([loader.sample(i)["inputs"][0] for loader in loaders for i in range(n)])
    assert len(validation) == len(test) == n
    assert not validation & test and not validation & training and not test & training


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


SWEEP = "name: s\nclaim: c\nmodels: [tiny_gdn]\nseeds: [1, 2, 3]\nmetrics: [accuracy]\neval: {task: mqar, seed: 0}\n"


@pytest.mark.parametrize("extra,message", [
    ("groups: {data: mqar}\nlrs: [0.001]\nvalidation: {seed: 2}\n",
     r"validation.seed=2 must differ from the training seeds \[1, 2, 3\] and the test's eval.seed=0"),
    ("groups: {data: mqar}\nlrs: [0.001]\nvalidation: {seed: 0}\n", r"validation.seed=0 must differ"),
    ("groups: {data: stdlib}\nlrs: [0.001]\n", r"lrs needs groups.data=mqar .*got 'stdlib'"),
    ("match_params: tiny_oryx_tg\n", r"match_params='tiny_oryx_tg' is not one of models \['tiny_gdn'\]"),
    ("smoke: {lr: [1]}\n", r"smoke.lr is not one of"),
    ("model_lrs: {tiny_gdn_hybrid4: 0.001}\n", r"model_lrs.tiny_gdn_hybrid4 is not one of models \['tiny_gdn'\]"),
    ("groups: {data: mqar}\nlrs: [0.001]\nmodel_lrs: {tiny_gdn: 0.001}\n",
     r"model_lrs.tiny_gdn beside lrs: a model is swept or given its rate, not both"),
])
def test_bad_sweep_settings_are_named(tmp_path, monkeypatch, extra, message):
    (tmp_path / "s.yaml").write_text(SWEEP + extra)
    monkeypatch.setattr(config, "EXPERIMENTS_DIR", tmp_path)
    with pytest.raises(ValueError, match=r"s.yaml: " + message):
        load_experiment("s", smoke="smoke" in extra)


def test_bad_experiment_file_names_the_field(tmp_path, monkeypatch):
    (tmp_path / "bad.yaml").write_text("name: bad\nclaim: c\nmodels: [tiny_gdn]\nseeds: [1]\nmetrics: [loss]\n"
                                       "eval: {task: ppl, num_windows: 3}\n")
    (tmp_path / "typo.yaml").write_text("name: typo\nclaim: c\nmodels: [tiny_gdn]\nseeds: [1]\nmetrics: [loss]\n"
                                        "eval: {task: ppl}\nvariant: {}\n")
    monkeypatch.setattr(config, "EXPERIMENTS_DIR", tmp_path)
    with pytest.raises(ValueError, match=r"bad.yaml: eval.num_windows is not an argument of ppl"):
        load_experiment("bad")
    with pytest.raises(ValueError, match=r"typo.yaml: .*variant"):
        load_experiment("typo")


def test_run_key_ignores_logging_and_follows_what_shapes_the_weights():
    base = ["data=mqar", "logging.wandb_mode=disabled"]
    key = runs.run_key(runs.compose_run("tiny_gdn", 1, base))
    # the keys runs were trained under: fields added since (at their defaults) and the one schema change none
    assert (key, runs.run_key(runs.compose_run("tiny_oryx_tm", 1, base))) == ("e2ec5d3e", "18fd929b")
    same = ["train.log_interval=7", "train.eval_interval=null", "logging.wandb_mode=offline", "checkpoint.dir=/x"]
    assert runs.run_key(runs.compose_run("tiny_gdn", 1, base + same)) == key
    for other in (["optimizer.lr=1e-4"], ["data.mqar_num_pairs=4"], ["model.num_layers=1"], ["data.reset_at_eod=true"]):
        assert runs.run_key(runs.compose_run("tiny_gdn", 1, base + other)) != key
    assert runs.run_key(runs.compose_run("tiny_gdn", 2, base)) != key
