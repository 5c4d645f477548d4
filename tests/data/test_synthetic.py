"""The synthetic MQAR loader: samples are pure functions of (seed, split, global index)."""

import dataclasses
import json
import math

import numpy as np
import pytest
import torch
from hydra import compose, initialize_config_dir

from oryx_megatron import RECIPES_DIR
from oryx_megatron.data.modes import random_chunks
from oryx_megatron.data.synthetic import MQARLoader
from oryx_megatron.data.tasks.mqar import solve_mqar
from oryx_megatron.run_config import ConfigError, load_train_config
from oryx_megatron.training.loop import pretrain

SCHEDULE = {"name": "random_chunks", "chunk_size": 8, "p_attention": 0.5}


def _loader(**kw):
    args = dict(seq_len=48, micro_batch_size=3, vocab_size=64, num_pairs=4, seed=7, mode_schedule=SCHEDULE)
    return MQARLoader(**{**args, **kw})


def _take(loader, n):
    return [next(loader) for _ in range(n)]


def _same(a, b):
    return len(a) == len(b) and all(x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x) for x, y in zip(a, b))


def test_batches_hold_the_answers_and_the_modes():
    loader = _loader(dp_rank=1, dp_size=2)
    dtypes = {"tokens": torch.int64, "labels": torch.int64, "loss_mask": torch.float32,
              "position_ids": torch.int64, "modes": torch.int8}
    for k, batch in enumerate(_take(loader, 3)):
        assert {key: t.dtype for key, t in batch.items()} == dtypes
        assert all(t.shape == (3, 48) for t in batch.values())
        assert (batch["tokens"][:, 1:] == batch["labels"][:, :-1]).all()
        assert (batch["position_ids"] == torch.arange(48)).all()
        indices = range(k * 6 + 3, k * 6 + 6)  # global samples of rank 1's k-th micro-batch
        assert torch.equal(batch["modes"], random_chunks(8, 0.5).batch(48, indices, seed=7))
        for row, i in enumerate(indices):
            sample = loader.sample(i)
            mask = batch["loss_mask"][row].bool()
            assert set(batch["loss_mask"][row].unique().tolist()) <= {0.0, 1.0}
            assert torch.equal(mask, torch.from_numpy(sample["answer_mask"][0]))
            answer_positions = 48 + 1 - 2 * 4 + 2 * np.arange(4)  # label positions of the 4 answers
            assert mask.nonzero().flatten().tolist() == answer_positions.tolist()
            assert batch["labels"][row][mask].tolist() == solve_mqar(sample)[0].tolist()
    assert loader.consumed_samples == 18 and loader.vocab_size == 64


def test_samples_do_not_depend_on_the_dp_layout():
    single = _take(_loader(micro_batch_size=4), 3)
    ranks = [_loader(micro_batch_size=2, dp_rank=r, dp_size=2) for r in range(2)]
    for k in range(3):
        halves = [next(r) for r in ranks]
        assert all(torch.equal(single[k][key], torch.cat([h[key] for h in halves])) for key in single[k])


def test_resume_continues_exactly_and_checks_identity():
    reference = _take(_loader(), 6)
    first = _loader()
    _take(first, 2)
    state = json.loads(json.dumps(first.state_dict()))  # plain values
    resumed = _loader()
    resumed.load_state_dict(state)
    assert _same(reference[2:], _take(resumed, 4))
    for other in (dict(seed=8), dict(num_pairs=5), dict(split="valid")):
        try:
            _loader(**other).load_state_dict(state)
        except ValueError:
            continue
        raise AssertionError(f"a loader with {other} accepted the state")


def test_splits_and_seeds_give_different_samples():
    train, valid, reseeded = (_take(_loader(**kw), 2) for kw in ({}, dict(split="valid"), dict(seed=8)))
    assert _same(train, _take(_loader(), 2))
    assert not any(torch.equal(a["tokens"], b["tokens"]) for a, b in zip(train, valid))
    assert not any(torch.equal(a["tokens"], b["tokens"]) for a, b in zip(train, reseeded))


def test_pretrain_runs_on_mqar(tmp_path):
    overrides = [
        "model.num_layers=2", "model.hidden_size=64", "model.num_attention_heads=4", "model.kv_channels=16",
        "model.ffn_hidden_size=128", "model.vocab_size=257", "model.max_sequence_length=64",
        "model.linear_chunk_size=16", "data=mqar", "data.seq_length=64", "data.mode_schedule.chunk_size=16",
        "train.micro_batch_size=2", "train.global_batch_size=4", "train.log_interval=1", "train.train_iters=5",
        "train.eval_interval=5", "train.eval_iters=1", "train.eval_schedules=[all_attention]",
        "optimizer.lr_warmup_iters=2", "logging.wandb_mode=disabled", "checkpoint.save_at_end=false",
        f"checkpoint.dir={tmp_path / 'ckpt'}",
    ]
    with initialize_config_dir(str(RECIPES_DIR), version_base=None):
        run = load_train_config(compose("train", overrides=overrides))
    assert run.data.format == "mqar" and not run.data.data_path
    assert pretrain(run, str(tmp_path / "out")) == 0
    rows = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    train_losses = [row["train/loss"] for row in rows if "train/loss" in row]
    eval_losses = [row["eval/loss_all_attention"] for row in rows if "eval/loss_all_attention" in row]
    assert len(train_losses) == 5 and len(eval_losses) == 1
    assert all(math.isfinite(x) for x in train_losses + eval_losses)


def test_mqar_config_needs_no_data_path_and_checks_the_task_sizes():
    def load(*overrides):
        with initialize_config_dir(str(RECIPES_DIR), version_base=None):
            return load_train_config(compose("train", overrides=["checkpoint.dir=/tmp/unused", *overrides]))

    run = load("data=mqar")
    assert (run.data.format, run.data.seq_length, run.data.mqar_num_pairs, run.data.mqar_vocab_size) == ("mqar", 128, 8, None)
    with pytest.raises(ConfigError, match="too short"):
        load("data=mqar", "data.seq_length=16")
    with pytest.raises(ConfigError, match="mqar_vocab_size"):
        load("data=mqar", "data.mqar_vocab_size=1")
    with pytest.raises(ConfigError, match="data_path"):
        load("data.data_path=[]")
    with pytest.raises(ConfigError, match=r"data.mqar_\*.*filler_id=3 is a key id"):
        load("data=mqar", "data.mqar_vocab_size=64", "data.mqar_filler_id=3")
    with pytest.raises(ConfigError, match=r"num_queries=9 exceeds num_pairs=8"):
        load("data=mqar", "data.mqar_num_queries=9")


def test_queries_and_filler():
    loader = _loader(num_pairs=6, num_queries=2, filler_id=63)
    batch = next(loader)
    assert batch["loss_mask"].sum(1).tolist() == [2.0] * 3  # one answer per query
    filler = batch["tokens"][:, 2 * 6 : 48 - 2 * 2 + 1]  # between the pairs and the first query key
    assert (filler == 63).all()
    with pytest.raises(ValueError, match="loader state has filler_id=None, this loader has filler_id=63"):
        loader.load_state_dict(_loader(num_pairs=6, num_queries=2).state_dict())


def test_scattered_queries_move_the_answers_and_are_part_of_the_state():
    loader = _loader(num_pairs=6, num_queries=4, query_spans=2, context_segments=3)
    batch = next(loader)
    for row in range(3):
        sample = loader.sample(row)
        assert torch.equal(batch["loss_mask"][row].bool(), torch.from_numpy(sample["answer_mask"][0]))
        assert batch["labels"][row][batch["loss_mask"][row].bool()].tolist() == solve_mqar(sample)[0].tolist()
    assert len({tuple(loader.sample(i)["query_positions"][0]) for i in range(8)}) > 1  # the spans move
    with pytest.raises(ValueError, match="loader state has query_spans=None, this loader has query_spans=2"):
        loader.load_state_dict(_loader(num_pairs=6, num_queries=4).state_dict())


def test_retrieval_eval_of_an_mqar_run_samples_its_training_distribution():
    from oryx_megatron.eval.retrieval import build_task

    with initialize_config_dir(str(RECIPES_DIR), version_base=None):
        run = load_train_config(compose("train", overrides=[
            "checkpoint.dir=/tmp/unused", "data=mqar", "data.seq_length=48", "data.mqar_vocab_size=64",
            "data.mqar_num_pairs=6", "data.mqar_num_queries=2", "data.mqar_filler_id=63"]))
    d = run.data
    sample, mixed, _ = build_task("mqar", run, 3, 48, 0, "random", d.mqar_num_pairs, d.mqar_num_queries, 1, 2, 4)
    assert sample["answer_mask"].sum(1).tolist() == [2] * 3 and mixed.n_last == 3
    assert (sample["inputs"][:, 12:45] == 63).all() and sample["inputs"].max() < 64
    with pytest.raises(ValueError, match="niah needs a tokenized dataset .*data.format=mqar"):
        build_task("niah", run, 3, 48, 0, "random", 6, 2, 1, 2, 4)
    scattered = dataclasses.replace(run, data=dataclasses.replace(d, mqar_filler_id=None, mqar_query_spans=2))
    sample, mixed, _ = build_task("mqar", scattered, 3, 48, 0, "random", 6, 2, 1, 2, 4)  # its training layout
    assert np.array_equal(mixed.batch(48, range(3)).numpy() == 1, sample["query_span_mask"])
    assert sample["query_span_mask"].sum(1).tolist() == [2] * 3  # 2 spans of one query: its key
    _, last, _ = build_task("mqar", scattered, 3, 48, 0, "random", 6, 2, 1, 2, 4, query_spans=0)
    assert last.n_last == 3
