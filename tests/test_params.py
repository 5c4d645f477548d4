"""oryx-params: the paper's >= 90% tying at every scale, and baselines of matched size."""

import re
import resource
import sys
from pathlib import Path

import pytest

from oryx_megatron.models.match_width import matched_ffn, parameter_count, with_ffn
from oryx_megatron.models.params import load_model_args, parameter_report
from tests.processes import run_cli

SCALES = ["130m", "370m", "760m", "1_4b"]
NOMINAL = {"130m": 130e6, "370m": 370e6, "760m": 760e6, "1_4b": 1.4e9}


def report(recipe):
    return parameter_report(load_model_args([f"model={recipe}"]))


@pytest.mark.parametrize("scale", SCALES)
@pytest.mark.parametrize("family", ["oryx_tg", "oryx_tm"])
def test_oryx_recipes_share_at_least_90_percent(family, scale):
    r = report(f"{family}_{scale}")
    assert r["shared_fraction"] >= 0.90
    assert 0 < r["single_mixer_fraction"] < 0.15
    assert abs(r["total"] / NOMINAL[scale] - 1) < 0.07  # the scale's name is honest


@pytest.mark.parametrize("scale", SCALES)
def test_baselines_match_the_oryx_parameter_count(scale):
    oryx = report(f"oryx_tg_{scale}")["total"]
    for baseline in ("transformer", "gdn", "mamba2", "oryx_tm"):
        r = report(f"{baseline}_{scale}")
        assert abs(r["total"] / oryx - 1) < 0.05, baseline
        if baseline != "oryx_tm":
            assert r["shared_fraction"] == 1.0  # one mixer: every parameter serves its mode


# The layer-axis hybrids (recipes/model/<linear>_hybrid<k>_<scale>.yaml: attention at 1 layer in k) and the Oryx
# recipe of their scale they are matched to; 1 in 8 where the depth has 16 layers or more.
HYBRIDS = [(f"{linear}_hybrid{k}_{scale}", f"{oryx}_{scale}", k) for linear, oryx in (("mamba2", "oryx_tm"),
           ("gdn", "oryx_tg")) for scale in SCALES for k in (4, 8) if (k, scale) != (8, "130m")]
TINY_HYBRIDS = [(f"tiny_{name}_hybrid4", f"tiny_{oryx}") for name, oryx in (("mamba2", "oryx_tm"), ("gdn", "oryx_tg"),
                ("oryx_tm", "oryx_tm"), ("oryx_tg", "oryx_tg"))]


@pytest.mark.parametrize("recipe,oryx,every", HYBRIDS)
def test_layer_axis_hybrids_match_their_oryx_recipe(recipe, oryx, every):
    """Within 2% of the Oryx recipe's parameters at its depth, width and heads, attention at every k-th layer."""
    hybrid, reference = load_model_args([f"model={recipe}"]), load_model_args([f"model={oryx}"])
    shape = lambda a: (a.num_layers, a.hidden_size, a.num_attention_heads, a.kv_channels)
    assert shape(hybrid) == shape(reference)
    letters = hybrid.layer_pattern.replace(" ", "")
    assert [i for i, letter in enumerate(letters) if letter == "*"] == list(range(every - 1, len(letters), every))
    assert set(letters) == {"*", {"mamba2": "M", "gdn": "G"}[hybrid.family]}
    assert abs(parameter_count(hybrid) / parameter_count(reference) - 1) <= 0.02


@pytest.mark.parametrize("recipe,oryx", TINY_HYBRIDS)
def test_tiny_hybrids_match_an_8_layer_tiny_oryx_model(recipe, oryx):
    hybrid, reference = load_model_args([f"model={recipe}"]), load_model_args([f"model={oryx}", "model.num_layers=8"])
    assert hybrid.num_layers == 8 and len(hybrid.layer_pattern.replace(" ", "")) == 8
    assert abs(parameter_count(hybrid) / parameter_count(reference) - 1) <= 0.02


def test_cli_prints_shared_fraction_without_allocating_weights():
    script = Path(sys.executable).with_name("oryx-params")
    out = run_cli([script, "model=oryx_tg_1_4b"], check=True).stdout
    assert re.search(r"^total_params=1,3\d\d,\d{3},\d{3}$", out, re.M), out
    fraction = float(re.search(r"^shared_fraction=([0-9.]+)$", out, re.M).group(1))
    assert fraction >= 0.90
    # 1.4B fp32 weights would take 5.6 GB; the meta-device build stays far below.
    peak_gb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20
    assert peak_gb < 2.0


def test_unknown_recipe_key_is_named():
    with pytest.raises(Exception, match="hidden_sise"):
        load_model_args(["model=tiny_oryx_tg", "+model.hidden_sise=3"])


# A one-layer Oryx-TG small enough to count by hand: hidden H = 8, 2 heads of d_k = d_v = 4
# (inner width 8), conv width 4, SwiGLU 16, tied embedding of 128 ids.
HAND = ["model.num_layers=1", "model.hidden_size=8", "model.num_attention_heads=2", "model.kv_channels=4",
        "model.ffn_hidden_size=16", "model.vocab_size=128"]


def test_tied_fractions_of_the_whole_model_and_of_the_mixer_by_hand():
    r = parameter_report(load_model_args(["model=tiny_oryx_tg", *HAND]))
    h, inner, heads, conv, ffn = 8, 8, 2, 4, 16
    shared = 3 * inner * h + 2 * inner * conv + inner + inner * h  # W_K W_V W_G, conv_k conv_v, out norm, W_O: 328
    attention = inner * h  # W_QA: 64
    linear = inner * h + inner * conv + 2 * heads * h + 2 * heads  # W_QL, conv_q, W_b W_a, A_log dt_bias: 132
    rest = 128 * h + 2 * h + 3 * h * ffn + h  # embedding, input and final norm, MLP and its norm: 1432
    assert (r["counts"]["mixer_shared"], r["counts"]["mixer_attention"], r["counts"]["mixer_linear"]) == (
        shared, attention, linear)
    assert r["total"] == rest + shared + attention + linear == 1956
    assert r["mixer_tied_fraction"] == pytest.approx({"attention": 328 / 392, "linear": 328 / 460})
    assert r["mixer_shared_fraction"] == pytest.approx(328 / 460)
    assert r["tied_fraction"] == pytest.approx({"attention": 1760 / 1824, "linear": 1760 / 1892})
    assert r["shared_fraction"] == pytest.approx(1760 / 1892)


def test_a_single_mixer_model_ties_its_whole_mixer():
    r = parameter_report(load_model_args(["model=tiny_transformer", *HAND]))
    assert r["mixer_tied_fraction"] == {"attention": 1.0, "linear": 1.0} and r["mixer_shared_fraction"] == 1.0


def test_a_layer_patterns_mixer_fractions_are_its_oryx_blocks():
    """O*MG: the mixer fractions are those of its one Oryx block, which an all-Oryx model of the same shape has at
    every layer; its single-mixer layers, read in either mode, raise the whole model's tied fraction."""
    patterned = parameter_report(load_model_args(["model=tiny_oryx_tm", "model.layer_pattern='O*MG'"]))
    oryx = parameter_report(load_model_args(["model=tiny_oryx_tm"]))
    assert patterned["mixer_tied_fraction"] == oryx["mixer_tied_fraction"]
    assert patterned["counts"]["mixer_attention"] == oryx["counts"]["mixer_attention"] // 4
    assert patterned["shared_fraction"] > oryx["shared_fraction"]


@pytest.mark.parametrize("scale", ["130m", "1_4b"])
def test_the_mixer_alone_ties_about_80_percent(scale):
    """The >= 90% holds for the whole model only (models/params.py says so)."""
    assert 0.78 < report(f"oryx_tg_{scale}")["mixer_shared_fraction"] < 0.82


def test_cli_labels_both_fractions():
    script = Path(sys.executable).with_name("oryx-params")
    out = run_cli([script, "model=tiny_oryx_tg", *HAND], check=True).stdout
    assert "# whole model: parameters both modes use / all parameters the mode uses" in out
    assert "# mixer alone: shared mixer parameters / mixer parameters the mode uses" in out
    for line in ("tied_fraction[linear]=0.9302", "shared_fraction=0.9302", "mixer_tied_fraction[attention]=0.8367",
                 "mixer_tied_fraction[linear]=0.7130", "mixer_shared_fraction=0.7130"):
        assert re.search(f"^{re.escape(line)}$", out, re.M), line


E1_SHAPE = ["model.num_layers=4", "model.hidden_size=64", "model.num_attention_heads=4", "model.kv_channels=16",
            "model.ffn_hidden_size=128", "model.vocab_size=64"]


@pytest.mark.parametrize("family", ["transformer", "gdn", "mamba2"])
def test_matched_mlp_width_brings_the_count_within_2_percent(family):
    reference = load_model_args(["model=tiny_oryx_tg", *E1_SHAPE])
    other = load_model_args([f"model=tiny_{family}", *E1_SHAPE])
    assert parameter_count(other) / parameter_count(reference) < 0.98  # unmatched: more than 2% apart
    ffn = matched_ffn(reference, other)
    matched = with_ffn(other, ffn)
    assert ffn % 8 == 0
    assert abs(parameter_count(matched) / parameter_count(reference) - 1) <= 0.02
    shape = lambda a: (a.num_layers, a.hidden_size, a.num_attention_heads, a.kv_channels)
    assert shape(matched) == shape(reference)  # equal depth and width: only the MLP differs


def test_no_matching_width_is_named():
    reference = load_model_args(["model=tiny_oryx_tg", *E1_SHAPE])
    other = load_model_args(["model=tiny_transformer", *E1_SHAPE])
    message = (r"no model.ffn_hidden_size in \[8, 64\] \(multiples of 8\) brings transformer within 2% of "
               r"oryx_tg's 210,784 parameters: the nearest, 64, gives [0-9,]+ \(-\d+\.\d%\); change model.hidden_size")
    with pytest.raises(ValueError, match=message):
        matched_ffn(reference, other, max_ffn=64)
