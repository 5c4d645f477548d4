"""generate() of the HF model. It routes through the core's routing pass (mixer/router.py):
``generate(schedule="router ...")`` gives oryx-generate's greedy tokens (``inference.generate`` on the megatron model the weights came from), for a
router of the first layer and one of two layers (its own all-linear pass), with a budget and with a threshold;
a forward given a router schedule reads the modes ``route_modes`` gives. A left-padded batch gives each row the
tokens it gives alone."""

import pytest
import torch

pytest.importorskip("transformers")

from oryx_megatron.data.schedules import as_inference_schedule  # noqa: E402
from oryx_megatron.inference import generate  # noqa: E402
from oryx_megatron.inference.routing import route_modes  # noqa: E402
from tests.test_hf import converted, megatron_model, tiny_args  # noqa: E402

SCHEDULES = ("router budget=0.1", "router threshold=0.5")
PROMPT, NEW = 10, 22


@pytest.fixture(scope="module", params=[1, 2], ids=["router_layers=1", "router_layers=2"])
def routed(request, single_process_parallel, one_thread):
    torch.manual_seed(3)
    args = tiny_args("oryx_tg", router_hidden=8, router_chunk_size=4, router_layers=request.param)
    megatron = megatron_model(args)
    with torch.no_grad():
        megatron.router.fc2.weight.normal_(std=3.0)  # logits on both sides of 0.5
        megatron.router.calibration.copy_(torch.linspace(0, 1, 101, dtype=torch.float64))
    return megatron, converted(megatron, args).eval()


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_router_schedules_in_generate_give_oryx_generates_tokens(routed, schedule):
    megatron, hf = routed
    torch.manual_seed(4)
    ids = torch.randint(0, 256, (2, PROMPT))
    want = generate(megatron, ids.tolist(), schedule, NEW)
    for use_cache in (True, False):  # decided as the tokens come, or by a routing pass over each step's sequence
        with torch.no_grad():
            got = hf.generate(ids, schedule=schedule, max_new_tokens=NEW, do_sample=False, use_cache=use_cache)
        assert got[:, PROMPT:].tolist() == want.tokens, use_cache
    if schedule.endswith("threshold=0.5"):  # the router chose both mixers: the routing decided the tokens
        assert min(want.stats.tokens_per_mode.values()) > 0, want.stats.tokens_per_mode


def test_a_router_schedule_as_modes_reads_route_modes(routed):
    megatron, hf = routed
    torch.manual_seed(5)
    ids = torch.randint(0, 256, (2, 3 * 4 + 1))
    schedule = "router threshold=0.5"
    modes = route_modes(megatron, as_inference_schedule(schedule), ids).long()
    assert 0 < int(modes.sum()) < modes.numel()  # both mixers read
    with torch.no_grad():
        assert torch.equal(hf(ids, modes=schedule).logits, hf(ids, modes=modes).logits)
        cache = hf.allocate_cache(2)
        hf(ids[:, :4], modes="all_attention", past_key_values=cache)
        with pytest.raises(ValueError, match=r"modes='router threshold=0.5' over a cache: pass the router schedule "
                                             r"to generate\(\)"):
            hf(ids[:, 4:5], modes=schedule, past_key_values=cache)


def test_a_model_without_a_router_refuses_a_router_schedule(single_process_parallel):
    hf = converted(megatron_model(tiny_args("oryx_tg")), tiny_args("oryx_tg"))
    with pytest.raises(ValueError, match=r"schedule 'router budget=0.1' needs a model with a router \(router.hidden\)"):
        hf.generate(torch.zeros(1, 4, dtype=torch.long), schedule="router budget=0.1", max_new_tokens=2)


PADDED = (10, 6, 8)  # prompt lengths of one batch, left-padded to the longest
PADDING_SCHEDULES = ("all_attention", "all_linear", "prefill=linear decode=attention", "linear:0-4,attention:4-")


@pytest.fixture(scope="module")
def models(single_process_parallel, one_thread):
    torch.manual_seed(6)
    return {family: converted(megatron_model(tiny_args(family)), tiny_args(family)).eval()
            for family in ("oryx_tg", "oryx_tm", "gdn", "mamba2")}


@pytest.mark.parametrize("family", ["oryx_tg", "oryx_tm", "gdn", "mamba2"])
def test_a_left_padded_batch_gives_each_row_its_tokens_alone(models, family):
    """Left padding (attention_mask 0) is a document of its own before each row's first token, and a schedule's
    positions count from that token: every row generates what it generates alone, cached or not."""
    hf = models[family]
    torch.manual_seed(7)
    prompts = [torch.randint(1, 256, (n,)) for n in PADDED]
    width = max(PADDED)
    ids = torch.stack([torch.cat([torch.zeros(width - len(p), dtype=torch.long), p]) for p in prompts])
    mask = torch.stack([torch.arange(width) >= width - len(p) for p in prompts]).long()
    schedules = PADDING_SCHEDULES if family.startswith("oryx") else PADDING_SCHEDULES[:1]
    for schedule in schedules:
        with torch.no_grad():
            alone = [hf.generate(p[None], schedule=schedule, max_new_tokens=NEW, do_sample=False)[0, len(p):]
                     for p in prompts]
            for use_cache in (True, False):
                got = hf.generate(ids, attention_mask=mask, schedule=schedule, max_new_tokens=NEW, do_sample=False,
                                  use_cache=use_cache)[:, width:]
                assert [row.tolist() for row in got] == [row.tolist() for row in alone], (schedule, use_cache)


def test_padding_the_model_cannot_read_is_refused_by_name(models):
    hf, ids = models["oryx_tg"], torch.ones(2, 6, dtype=torch.long)
    right = torch.tensor([[1] * 6, [1] * 4 + [0] * 2])
    with pytest.raises(ValueError, match=r"attention_mask pads on the right or inside a row: an Oryx model takes left "
                                         r"padding \(tokenizer.padding_side = 'left'\)"):
        hf(ids, attention_mask=right)
    left = right.flip(1)
    with pytest.raises(ValueError, match=r"schedule 'router budget=0.1' with a padded batch \(attention_mask\): the "
                                         r"router's chunks start at each row's first token"):
        hf.generate(ids, attention_mask=left, schedule="router budget=0.1", max_new_tokens=2)
    cache = hf.allocate_cache(2)
    hf(ids, past_key_values=cache)
    with pytest.raises(ValueError, match=r"attention_mask pads tokens fed after position 6: only a prompt is padded"):
        hf(ids[:, :1], attention_mask=torch.tensor([[1] * 7, [1] * 6 + [0]]), past_key_values=cache)
