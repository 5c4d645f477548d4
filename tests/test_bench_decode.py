"""benchmarks/bench_decode.py at a tiny size: every row of the Transformer (stock LlamaForCausalLM) and of Oryx-TG
(the pinned Hugging Face front end, in a subprocess) measures with the peer's greedy tokens equal to ours (the
benchmark asserts it), and the table names each row; the foreign peers (transformers' Mamba2ForCausalLM, an
all-Gated-DeltaNet Qwen3NextForCausalLM) take our model's shape and time their rows. No timing is asserted."""

import dataclasses

import pytest
import torch

from benchmarks import bench_decode as bench
from oryx_megatron.models.builder import build_model, transformer_config
from oryx_megatron.models.params import load_model_args

pytestmark = pytest.mark.usefixtures("single_process_parallel", "one_thread")


def test_a_tiny_run_prints_every_row_with_equal_tokens(capsys):
    assert bench.main(["--families", "transformer", "oryx_tg", "--batches", "1", "--prompt", "16",
                       "--new-tokens", "4", "--repeats", "1", "--peers", "same-weights"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].split() == list(bench.COLUMNS)
    rows = [line for line in lines[3:] if not line.startswith("missed")]
    names = [(r.split()[0], " ".join(r.split()[1:-9])) for r in rows]
    assert names == [("transformer", "all_attention")] + [("oryx_tg", s) for s in bench.SCHEDULES["oryx_tg"]]


@pytest.mark.parametrize("family", ["mamba2", "oryx_tm", "gdn", "oryx_tg"])
def test_the_foreign_peer_takes_our_shape_and_times_its_rows(family):
    # a reduced shape whose d_k, d_v and conv kernel are not the defaults, so a field mapped wrong shows
    args = dataclasses.replace(load_model_args([f"model=tiny_{family}"]), num_layers=2, hidden_size=64,
                               num_attention_heads=2, kv_channels=16, value_head_dim=32, mixer_conv_kernel=3,
                               ffn_hidden_size=96, vocab_size=512)
    torch.manual_seed(0)
    model = build_model(args, transformer_config(args, perform_initialization=True)).eval()
    if bench.FOREIGN[family] == "mamba2":
        hf = bench.mamba2_model(args)
        c = hf.config
        assert (c.num_hidden_layers, c.hidden_size, c.num_heads, c.head_dim, c.state_size, c.n_groups,
                c.conv_kernel) == (2, 64, 2, 32, 16, 2, 3)
        layout = model.decoder.layers[0].mixer.layout  # our streams z|x|B|C|dt, less Oryx-TM's attention query
        linear = sum(w for stream, w in layout.streams.items() if stream != layout.attention_query)
        assert hf.backbone.layers[0].mixer.in_proj.weight.shape == (2 * linear, 64)
        embedding = hf.backbone.embeddings
    else:
        hf = bench.qwen3_next_gdn_model(args)
        c = hf.config
        assert c.layer_types == ["linear_attention"] * 2
        assert (c.num_hidden_layers, c.hidden_size, c.linear_num_key_heads, c.linear_num_value_heads,
                c.linear_key_head_dim, c.linear_value_head_dim, c.linear_conv_kernel_dim,
                c.intermediate_size) == (2, 64, 2, 2, 16, 32, 3, 96)
        assert all(type(layer.mlp).__name__ == "Qwen3NextMLP" for layer in hf.model.layers)  # dense, no MoE
        embedding = hf.model.embed_tokens
    assert c.vocab_size == model.vocab_size == 512 and hf.lm_head.weight is embedding.weight  # tied
    assert not hf.use_kernels

    rows = list(bench.foreign_rows(family, model, args, [1, 2], prompt_len=8, new=3, repeats=1))
    name = bench.FOREIGN_NAMES[bench.FOREIGN[family]]
    assert [(r["family"], r["schedule"], r["batch"], r["peer"]) for r in rows] == \
        [(family, "all_linear", 1, name), (family, "all_linear", 2, name)]
    for r in rows:
        assert list(r) == list(bench.COLUMNS) and r["target"] == bench.FOREIGN_TARGET
        assert min(r[k] for k in bench.COLUMNS[4:]) > 0
    assert name in bench.table(rows)


def test_check_holds_each_row_to_the_issues_target(monkeypatch, capsys):
    """--check: 0.8 at batch 1 for the Transformer and the Oryx families against their same-weight peers, 1.0 at
    batch 8; 1.0 for the gdn / mamba2 baselines against the pinned front end and for every foreign peer."""
    def rows_of(family, batches, *args):  # decode ratio 0.9 everywhere: only the 0.8 rows miss
        for batch in batches:
            for same_weights in (True, False):
                timed = [dict(prefill_ms=1.0, decode_ms=0.9)], [dict(prefill_ms=1.0, decode_ms=1.0)]
                yield bench.row(family, "all_linear", batch, "peer" if same_weights else "foreign", *timed,
                                bench.target(family, batch, same_weights))

    monkeypatch.setattr(bench, "rows_of", rows_of)
    monkeypatch.setattr(bench, "extract_pinned", lambda folder: None)
    assert bench.main(["--families", "gdn", "mamba2", "--check"]) == 0
    assert bench.main(["--families", "gdn", "oryx_tg", "transformer", "--check"]) == 1
    missed = [line for line in capsys.readouterr().out.splitlines() if line.startswith("missed")]
    assert missed == [f"missed: {family} all_linear batch 1 against peer: decode 0.90x > 0.8x"
                      for family in ("oryx_tg", "transformer")]
