"""The lm-eval adapter (``OryxLM``, and the model ``oryx`` built from a checkpoint) on a tiny
checkpoint and a local multiple-choice task."""

import json
import os

import pytest
import torch

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
lm_eval = pytest.importorskip("lm_eval")

from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

from oryx_megatron.eval.lm_eval_adapter import OryxLM, pair_modes, score_continuation  # noqa: E402
from oryx_megatron.eval.lm_eval_harness import OryxCheckpointLM  # noqa: E402  (registers "oryx")

DOCS = [
    {"question": "import", "choices": ["os", "}{", "9x"], "label": 0},
    {"question": "def main(self", "choices": ["):", "]]", "@@"], "label": 0},
    {"question": "for i in", "choices": ["range(n):", "{{", "=)"], "label": 0},
    {"question": "return", "choices": ["None", ")(", "#!"], "label": 0},
    {"question": "class Foo", "choices": ["(object):", "[[", "=="], "label": 0},
    {"question": "if x is", "choices": ["None:", "}}", "(("], "label": 1},
]


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint, one_thread):
    return tiny_checkpoint


@pytest.fixture(scope="module")
def lm(checkpoint):
    return OryxCheckpointLM(checkpoint=checkpoint, schedule="prefill=linear decode=attention", batch_size=4)


def test_loglikelihood_matches_score_and_model_loss(lm):
    tok = lm.tokenizer
    context, continuation = "def main(", "self):"
    ctx = [int(i) for i in tok.encode_batch([context])[0]]
    cont = [int(i) for i in tok.encode_batch([continuation])[0]]
    (logprob, greedy), = lm.loglikelihood([Instance("loglikelihood", {}, (context, continuation), 0)])
    expected, expected_greedy = score_continuation(lm.model, ctx, cont, lm.schedule)
    assert logprob == pytest.approx(expected, abs=1e-5) and greedy == expected_greedy
    assert logprob < 0

    seq = torch.tensor([ctx + cont])
    modes = torch.from_numpy(pair_modes(lm.schedule, len(ctx), len(cont)))[None]
    assert modes[0, : len(ctx)].eq(0).all() and modes[0, len(ctx):].eq(1).all()  # linear prompt, attention after
    with torch.no_grad():
        loss = lm.model(seq[:, :-1], modes, labels=seq[:, 1:])  # [1, s] per-token loss
    model_logprob = -float(loss[0, len(ctx) - 1:].sum())
    assert logprob == pytest.approx(model_logprob, abs=1e-5)  # the model's own log-likelihood

    # batched (right-padded) scoring equals one-at-a-time scoring
    requests = [Instance("loglikelihood", {}, (c, " " + x), 0) for c, x in [("import", "os"), ("x", "= 1\nprint(x)")]]
    for (batched, _), request in zip(lm.loglikelihood(requests), requests):
        c, x = lm._encode_pair(*request.args)
        assert batched == pytest.approx(score_continuation(lm.model, c, x, lm.schedule)[0], abs=1e-5)

    # the library adapter on an already loaded model and tokenizer answers the same
    loaded = OryxLM(lm.model, lm.tokenizer, "prefill=linear decode=attention", batch_size=2)
    assert loaded.max_length == lm.max_length == lm.run.model.max_sequence_length
    assert loaded.loglikelihood(requests) == lm.loglikelihood(requests)


def test_rolling_and_generate(lm):
    text = "import os\nimport sys\n"
    (rolling,) = lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (text,), 0)])
    (pair, _), = lm.loglikelihood([Instance("loglikelihood", {}, ("", text), 0)])
    assert rolling == pytest.approx(pair, abs=1e-5) and rolling < 0
    outs = lm.generate_until([Instance("generate_until", {}, ("def ", {"until": ["\n"], "max_gen_toks": 8}), 0),
                              Instance("generate_until", {}, ("import", {"until": ["("], "max_gen_toks": 5}), 1)])
    assert len(outs) == 2 and "\n" not in outs[0] and "(" not in outs[1] and len(outs[1]) <= 5


def test_the_transformer_baseline_generates_until_a_stop(transformer_checkpoint, one_thread):
    lm = OryxCheckpointLM(checkpoint=transformer_checkpoint, batch_size=2)
    outs = lm.generate_until([Instance("generate_until", {}, ("def ", {"until": ["\n"], "max_gen_toks": 8}), 0),
                              Instance("generate_until", {}, ("import", {"until": ["("], "max_gen_toks": 5}), 1)])
    assert len(outs) == 2 and "\n" not in outs[0] and "(" not in outs[1] and len(outs[1]) <= 5


def test_simple_evaluate_multiple_choice(checkpoint, tmp_path):
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    (tmp_path / "oryx_code_mc.yaml").write_text(
        "task: oryx_code_mc\n"
        "dataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {data}\n  cache_dir: {tmp_path / 'hf_cache'}\n"
        "test_split: test\n"
        "output_type: multiple_choice\n"
        "doc_to_text: '{{question}}'\n"
        "doc_to_choice: choices\n"
        "doc_to_target: label\n"
        "metric_list:\n  - metric: acc\n"
    )
    results = lm_eval.simple_evaluate(
        model="oryx", model_args=f"checkpoint={checkpoint},schedule=all_attention", tasks=["oryx_code_mc"],
        task_manager=TaskManager(include_path=str(tmp_path)), bootstrap_iters=0, log_samples=False,
    )
    acc = results["results"]["oryx_code_mc"]["acc,none"]
    assert 0 <= acc <= 1

    lm = OryxCheckpointLM(checkpoint=checkpoint)  # all_attention
    correct = 0
    for doc in DOCS:
        ctx = [int(i) for i in lm.tokenizer.encode_batch([doc["question"]])[0]]
        scores = [score_continuation(lm.model, ctx, [int(i) for i in lm.tokenizer.encode_batch([" " + c])[0]],
                                     "all_attention")[0] for c in doc["choices"]]
        correct += int(max(range(len(scores)), key=lambda i: (scores[i], -i)) == doc["label"])
    assert acc == pytest.approx(correct / len(DOCS))
