"""router=posthoc (training/router.py): the targets are the per-chunk loss differences of two separate
forwards, training changes the router and nothing else, the checkpoint carries it calibrated, and
oryx-generate runs a router budget schedule on it end to end."""

import json
import sys
from pathlib import Path

import pytest
import torch

from oryx_megatron.config import Mode
from oryx_megatron.inference.checkpoint import load_model
from oryx_megatron.run_config import ConfigError, RouterConfig
from oryx_megatron.training.loop import pretrain
from oryx_megatron.training.router import chunk_means, router_loss, router_targets
from tests.processes import run_cli
from tests.test_train import run_config

CHUNK = 16


def test_chunk_means_by_hand():
    values = torch.arange(10, dtype=torch.float64)[None]  # one sample of 10, chunks of 4
    mask = torch.tensor([[1, 1, 0, 1, 1, 1, 1, 1, 0, 0]], dtype=torch.float64)
    means, count = chunk_means(values, mask, 4)
    assert count.tolist() == [[3, 4, 0]] and means.tolist() == [[(0 + 1 + 3) / 3, (4 + 5 + 6 + 7) / 4, 0]]


def test_a_chunk_without_loss_masked_tokens_teaches_the_router_linear():
    """A recall task masks the loss to its answers: the chunks of keys and values carry no benefit of
    their own and must count as linear targets, else the router only ever sees the answers' chunks
    (all targets) and learns p = 1 everywhere."""
    logits = torch.zeros(1, 3, requires_grad=True)
    benefit, count = torch.tensor([[0.0, 0.5, 0.01]]), torch.tensor([[0, 2, 2]])
    loss, target = router_loss(logits, benefit, count, RouterConfig(objective="classification", benefit_threshold=0.05))
    loss.backward()
    assert target.tolist() == [[False, True, False]]
    assert abs(loss.item() - torch.log(torch.tensor(2.0)).item()) < 1e-6  # BCE at p = 0.5, every chunk
    assert logits.grad[0].tolist() == pytest.approx([0.5 / 3, -0.5 / 3, 0.5 / 3])  # pushed down, up, down


@pytest.fixture(scope="module")
def posthoc(corpus, tiny_checkpoint, tmp_path_factory):
    """A post-hoc router fitted to the tiny trained Oryx-TG (frozen), 12 iterations. Every chunk whose attention
    read does not cost a nat is a target, so the router wants attention nearly everywhere (p >= 0.5, the floor of
    a budget's threshold) and a budget is what limits it."""
    tmp = tmp_path_factory.mktemp("posthoc")
    run = run_config(corpus, tmp, "router=posthoc", f"router.init_from={tiny_checkpoint}", "model.router_hidden=16",
                     f"model.router_chunk_size={CHUNK}", "train.train_iters=12", "train.log_interval=4",
                     "optimizer.lr=3e-2", "router.calibration_batches=2", "router.benefit_threshold=-1.0")
    assert pretrain(run, str(tmp / "out")) == 0
    return run, tmp


def test_targets_are_the_chunk_loss_differences_of_two_forwards(posthoc, tiny_checkpoint):
    run, _ = posthoc
    model, _ = load_model(tiny_checkpoint)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 257, (2, 49), generator=g)
    batch = {"tokens": ids[:, :-1], "labels": ids[:, 1:], "loss_mask": torch.ones(2, 48)}
    benefit, count, _ = router_targets(model, batch, CHUNK)
    with torch.no_grad():
        per_mode = [model(batch["tokens"], torch.full((2, 48), mode, dtype=torch.int8), labels=batch["labels"])
                    for mode in (Mode.LINEAR, Mode.ATTENTION)]
    by_hand = torch.stack([(per_mode[0] - per_mode[1])[:, c * CHUNK : (c + 1) * CHUNK].mean(1) for c in range(3)], 1)
    assert (benefit - by_hand).abs().max() < 1e-6 and count.tolist() == [[CHUNK] * 3] * 2


def test_posthoc_training_changes_the_router_only_and_calibrates_it(posthoc, tiny_checkpoint):
    run, tmp = posthoc
    rows = [json.loads(line) for line in (tmp / "out" / "metrics.jsonl").read_text().splitlines()]
    logged = [r for r in rows if "router/loss" in r]
    assert [r["iteration"] for r in logged] == [4, 8, 12]
    assert logged[-1]["router/loss"] < logged[0]["router/loss"]
    for r in logged:
        assert 0 <= r["router/attention_fraction"] <= 1 and 0 <= r["router/target_fraction"] <= 1
        assert r["router/loss_routed"] > 0
    trained, _ = load_model(str(tmp / "ckpt"))
    base, _ = load_model(tiny_checkpoint)
    base_weights = dict(base.named_parameters())
    for name, p in trained.named_parameters():
        if not name.startswith("router."):
            assert torch.equal(p, base_weights[name]), name  # frozen
    assert trained.router.fc2.weight.abs().sum() > 0  # was zero at initialisation
    calibration = trained.router.calibration
    assert not calibration.isnan().any() and (calibration[1:] >= calibration[:-1]).all()


def test_oryx_generate_runs_a_router_budget_schedule(posthoc):
    """Threshold 0 under the budget: every chunk wants attention, the quota alone decides (a 12-step router's
    own p may stay below 0.5 on this prompt, where a budget alone reads nothing)."""
    _, tmp = posthoc
    out = run_cli([sys.executable, "-m", "oryx_megatron.cli.generate", str(tmp / "ckpt"), "--prompt",
                   "def main(" * 3, "--max-new-tokens", "36", "--schedule", "router budget=0.25 threshold=0"],
                  cwd=Path(__file__).parents[1])
    assert out.returncode == 0, out.stderr[-2000:]
    assert "schedule: router threshold=0.0 budget=0.25" in out.stdout
    fraction = float(next(line for line in out.stdout.splitlines() if line.startswith("attention-token fraction"))
                     .split()[-1])
    assert 0 < fraction <= 0.25 + CHUNK / (27 + 35)  # some chunk reads attention; the budget + one chunk of 62


def test_eval_tasks_add_a_router_row_and_curve(posthoc, tmp_path):
    from oryx_megatron.eval.mode_switch import evaluate_mode_switch
    from oryx_megatron.eval.ppl import evaluate_ppl
    from oryx_megatron.data.schedules import RouterSchedule

    _, tmp = posthoc
    model, run = load_model(str(tmp / "ckpt"))
    router = RouterSchedule(budget=0.25)
    rows = {r["schedule"]: r for r in evaluate_ppl(model, run, num_batches=2, batch_size=2, router=router)["rows"]}
    assert set(rows) == {"all_attention", "all_linear", "random_chunks", "linear_then_attention", "router budget=0.25"}
    assert 0 < rows["router budget=0.25"]["attention_fraction"] <= 0.25 + CHUNK / run.data.seq_length
    assert rows["router budget=0.25"]["loss"] > 0
    result = evaluate_mode_switch(model, run, tmp_path, num_batches=1, batch_size=2, router=router)
    header = (tmp_path / "mode_switch.csv").read_text().splitlines()[0].split(",")
    assert header[-1] == "loss_router budget=0.25" and len(result["rows"]) == 2


def test_oryx_eval_refuses_a_bad_router_spec_in_one_line(posthoc):
    _, tmp = posthoc
    out = run_cli([sys.executable, "-m", "oryx_megatron.cli.evaluate", str(tmp / "ckpt"), "--task", "ppl",
                   "--router", "budget=2"])
    assert out.returncode == 2
    assert out.stderr.strip().splitlines()[-1] == (
        "oryx-eval: error: argument --router: inference schedule 'router budget=2.0': budget=2.0 is not in [0, 1]")


def test_joint_routing_trains_the_router_holds_the_budget_price_and_resumes_exactly(corpus, tmp_path):
    """router=joint: modes drawn from the router, straight-through: its weights change, the price of
    attention rises while the share of p >= 0.5 (what inference reads) exceeds the budget, and a resumed
    run continues exactly
    (the draws come from the checkpointed RNG, the price from the checkpointed router)."""
    both = ["router=joint", "model.router_hidden=8", f"model.router_chunk_size={CHUNK}", "router.budget=0.2",
            "router.price_lr=0.5", "train.train_iters=6", "checkpoint.save_at_end=true", "optimizer.lr=1e-2"]
    straight = run_config(corpus, tmp_path / "a", *both)
    assert pretrain(straight, str(tmp_path / "a" / "out")) == 0
    split = run_config(corpus, tmp_path / "b", *both, "train.exit_interval=3")
    assert pretrain(split, str(tmp_path / "b" / "out")) == 0
    assert pretrain(split, str(tmp_path / "b" / "out")) == 0
    rows = {d: [json.loads(line) for line in (tmp_path / d / "out" / "metrics.jsonl").read_text().splitlines()]
            for d in ("a", "b")}
    losses = {d: [r["train/loss"] for r in rows[d] if "train/loss" in r] for d in rows}
    assert len(losses["a"]) == 6 and losses["a"] == losses["b"]
    prices = [r["router/price"] for r in rows["a"] if "router/price" in r]
    logged = [r for r in rows["a"] if "router/price" in r]
    fractions = [r["router/read_fraction"] for r in logged]  # p >= 0.5, of every token
    assert fractions[0] > 0.2 and prices[0] > 0  # p ~ 0.5 at first: more than the budget, so attention gets a price
    for before, price, fraction in zip([0.0] + prices, prices, fractions):  # dual ascent on the logged share
        assert price == pytest.approx(max(0.0, before + 0.5 * (fraction - 0.2)), abs=1e-6)
    drawn = [r["router/attention_fraction"] for r in logged]  # a ~ Bernoulli(p): another share than p >= 0.5's
    assert all(0 <= d <= 1 for d in drawn) and drawn != fractions
    trained, _ = load_model(str(tmp_path / "a" / "ckpt"))
    assert trained.router.fc2.weight.abs().sum() > 0 and float(trained.router.price) == prices[-1]


def test_joint_routing_prices_every_token_and_counts_rounded_weights_as_attention():
    """A recall task's loss covers its answers only: the price of attention (and the fraction the budget
    holds) still counts every token. The weights a + p - p.detach() are 0/1 up to rounding."""
    from oryx_megatron.training.joint_routing import routed_loss_func

    p = torch.full((1, 4), 0.3)
    weights = torch.tensor([[1.0, 0.0, 1.0, 1.0]]) + p - p.detach()  # 1 + 0.3 - 0.3 != 1 in fp32
    mask = torch.tensor([[0.0, 1.0, 0.0, 0.0]])  # one answer, reading linear
    reads = torch.tensor([[True, False, False, True]])  # p >= 0.5: what inference would read
    total, count, report = routed_loss_func(mask, weights, torch.full((1, 4), 2.0), attention_cost=0.5 * weights,
                                            reads_at_inference=reads)
    assert report["routed_tokens"].tolist() == [3, 2, 4] and int(count) == 1
    assert report["loss_sums"].tolist() == [2.0, 1.0, 0.0, 0.0]  # the LM loss's sums: the answer, linear
    assert float(total) == pytest.approx(2.0 + 0.5 * 3)  # the price of the three attention tokens


def test_the_score_function_estimator_adds_zero_to_the_loss_and_reinforce_to_the_router():
    """router.estimator=score_function: the loss's value is the straight-through one's (LM loss and price);
    its gradient in the router's logits is d log P(drawn) x (each token's loss and price - the batch's mean at
    its position), summed over the tokens of each chunk."""
    from oryx_megatron.training.joint_routing import routed_loss_func

    logits = torch.tensor([[0.3, -1.0], [2.0, 0.5]], dtype=torch.float64, requires_grad=True)  # [b=2, n=2 chunks]
    drawn = torch.tensor([[1.0, 0.0], [0.0, 0.0]], dtype=torch.float64)
    log_prob = torch.where(drawn > 0, torch.nn.functional.logsigmoid(logits), torch.nn.functional.logsigmoid(-logits))
    modes, log_prob = drawn.repeat_interleave(2, dim=1), log_prob.repeat_interleave(2, dim=1)  # chunks of 2 tokens
    per_token_loss = torch.tensor([[1.0, 2.0, 3.0, 4.0], [0.5, 1.5, 2.5, 3.5]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 0.0, 1.0, 1.0], [1.0, 1.0, 0.0, 1.0]])
    cost = 0.25 * modes
    total, count, report = routed_loss_func(mask, modes, per_token_loss, attention_cost=cost,
                                            reads_at_inference=modes > 0.5, log_prob=log_prob)
    assert float(total.detach()) == pytest.approx(float((per_token_loss * mask).sum() + cost.sum())) and int(count) == 6
    total.backward()
    r = (per_token_loss * mask + cost).view(2, 2, 2).sum(-1)  # [b, n]: each chunk's losses and price
    baseline = (per_token_loss * mask + cost).mean(0).view(2, 2).sum(-1)  # the batch's mean, per position, summed
    p = torch.sigmoid(logits.detach())
    expected = torch.where(drawn > 0, 1 - p, -p) * (r - baseline)  # d log P(drawn) / d logit x advantage
    assert torch.allclose(logits.grad, expected, atol=1e-12)


def test_joint_routing_with_the_score_function_trains_the_router_and_refuses_another_estimator(corpus, tmp_path):
    run = run_config(corpus, tmp_path, "router=joint", "router.estimator=score_function", "model.router_hidden=8",
                     f"model.router_chunk_size={CHUNK}", "router.budget=0.2", "train.train_iters=3",
                     "checkpoint.save_at_end=true", "optimizer.lr=1e-2")
    assert pretrain(run, str(tmp_path / "out")) == 0
    trained, _ = load_model(str(tmp_path / "ckpt"))
    assert trained.router.fc2.weight.abs().sum() > 0  # zero at the start: the router's gradient reached it
    rows = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert all(0 <= r["router/read_fraction"] <= 1 for r in rows if "router/read_fraction" in r)
    with pytest.raises(ConfigError, match="config key 'router.estimator': 'reinforce'; expected 'straight_through' "
                                          "or 'score_function'"):
        run_config(corpus, tmp_path / "bad", "router=joint", "router.estimator=reinforce", "model.router_hidden=8")


def test_joint_routing_from_a_trained_model_starts_from_its_weights(corpus, tiny_checkpoint, tmp_path):
    run = run_config(corpus, tmp_path, "router=joint", f"router.init_from={tiny_checkpoint}", "model.router_hidden=8",
                     f"model.router_chunk_size={CHUNK}", "train.train_iters=2", "optimizer.lr=1e-12", "optimizer.min_lr=1e-12",
                     "checkpoint.save_at_end=true")
    assert pretrain(run, str(tmp_path / "out")) == 0
    joint, _ = load_model(str(tmp_path / "ckpt"))
    base, _ = load_model(tiny_checkpoint)
    weights = dict(base.named_parameters())
    assert all(torch.allclose(param, weights[name], atol=1e-8) for name, param in joint.named_parameters()
               if not name.startswith("router."))


def test_the_entropy_baseline_reads_the_chunks_of_highest_score():
    from oryx_megatron.eval.routing import top_chunks

    scores = torch.tensor([[0.1, 0.9, 0.5], [0.8, 0.2, 0.3]])  # [samples, chunks of 2 tokens]
    assert top_chunks(scores, 2 / 6, chunk_size=2, seq_len=5).tolist() == [[0, 0, 1, 1, 0], [1, 1, 0, 0, 0]]


def test_routing_evaluation_on_held_out_loss(posthoc):
    """eval/routing.py's ppl quality: the router at a budget and the schedules reading its fraction."""
    from oryx_megatron.eval.routing import evaluate_routing

    _, tmp = posthoc
    model, run = load_model(str(tmp / "ckpt"))
    rows = {r["schedule"]: r for r in evaluate_routing(model, run, "ppl", budgets=[0.25], thresholds=[0.0],
                                                        num_batches=1, batch_size=2)["rows"]}
    assert set(rows) == {f"{kind}@{tag}" for kind in ("router", "random", "first", "last", "entropy")
                         for tag in ("0.25", "p0")} | {"all_linear", "all_attention"}
    for label in ("router@p0", "first@p0", "entropy@p0"):  # p >= 0 everywhere: every chunk reads attention
        assert rows[label]["attention_fraction"] == 1 and rows[label]["loss"] == pytest.approx(rows["all_attention"]["loss"])
    assert rows["router@p0"]["threshold"] == 0.0 and rows["router@p0"]["budget"] is None
    fraction = rows["router@0.25"]["attention_fraction"]
    assert 0 < fraction <= 0.25 + CHUNK / run.data.seq_length  # a router that reads attention somewhere
    n = run.data.seq_length // CHUNK
    assert rows["first@0.25"]["attention_fraction"] == pytest.approx(round(fraction * n) / n)
    assert rows["entropy@0.25"]["attention_fraction"] == pytest.approx(fraction, abs=0.5 / (n * 2))  # of all chunks
    assert rows["all_attention"]["attention_fraction"] == 1 and rows["all_linear"]["attention_fraction"] == 0
    assert all(r["loss"] > 0 and r["se"] >= 0 for r in rows.values())
