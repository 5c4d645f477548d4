"""benchmarks/bench_inference.py: a CPU toy run prints the table with every schedule row and writes its JSON;
a row that raises costs that row alone, and a CUDA-graph row that cannot capture decodes eagerly beside its
eager row."""

import json

import pytest

from benchmarks import bench_inference as bench

pytestmark = pytest.mark.usefixtures("single_process_parallel", "one_thread")


def test_cpu_toy_run_prints_every_schedule_row(tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert bench.main(["--device", "cpu", "--contexts", "32", "64", "--batches", "1", "2", "--new-tokens", "4",
                       "--repeats", "1", "--json", str(out)]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[1].split() == list(bench.COLUMNS)
    rows = [line.split() for line in table[3:]]
    expected = [(s, "False", c, b, "ok") for c in (32, 64) for b in (1, 2)
                for s in bench.SCHEDULES + (("speculative k=4",) if b == 1 else ())]
    assert [(" ".join(r[:-10]), r[-10], int(r[-9]), int(r[-8]), r[-1]) for r in rows] == expected
    data = json.loads(out.read_text())
    assert data["model"] == "tiny_oryx_tg" and len(data["rows"]) == len(expected)
    for row in data["rows"]:
        assert row["decode_tok_per_s"] > 0 and row["prefill_s"] > 0 and row["cache_mb"] > 0
        assert (row["acceptance"] is None) == (not row["schedule"].startswith("speculative"))
        if row["schedule"] == "all_attention":
            assert row["vs_attention"] == 1.0


def test_a_checkpoint_is_benchmarked_with_its_trained_weights(tiny_checkpoint, capsys):
    assert bench.main(["--device", "cpu", "--checkpoint", tiny_checkpoint, "--contexts", "16", "--batches", "1",
                       "--new-tokens", "4", "--repeats", "1"]) == 0
    header = capsys.readouterr().out.splitlines()[0]
    assert header.startswith(f"model oryx_tg from {tiny_checkpoint} (trained), float32")


def test_a_graph_row_that_fails_leaves_its_eager_row(tmp_path, capsys):
    """On CPU a CUDA-graph row cannot run: it is a failed row with the reason, and the eager row beside
    it, and every row after it, still measure."""
    out = tmp_path / "bench.json"
    assert bench.main(["--device", "cpu", "--contexts", "16", "--batches", "1", "--new-tokens", "2", "--repeats", "1",
                       "--speculative", "0", "--cuda-graphs", "both", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["schedule"], r["graphs"], r["status"]) for r in rows] == [
        (s, graphs, "failed" if graphs else "ok") for s in bench.SCHEDULES for graphs in (False, True)]
    for row in rows:
        if row["graphs"]:
            assert row["error"] == "ValueError: cuda_graphs=True needs the model on a CUDA device; it is on cpu"
        else:
            assert row["decode_tok_per_s"] > 0 and row["error"] is None
    assert "all_attention graphs=True context=16 batch=1: failed: ValueError" in capsys.readouterr().out


def test_a_capture_that_raises_decodes_eagerly_and_says_so(tmp_path, monkeypatch):
    """Where graphs may be asked for (CUDA), a capture that raises does not lose the row: it decodes
    eagerly and carries the error. Reached on CPU by letting generate() ask for graphs: the capture then
    fails for real."""
    from oryx_megatron.inference import generation, speculative

    for module in (generation, speculative):
        monkeypatch.setattr(module, "use_cuda_graphs", lambda requested, device: bool(requested))
    out = tmp_path / "bench.json"
    assert bench.main(["--device", "cpu", "--contexts", "16", "--batches", "1", "--new-tokens", "3", "--repeats", "1",
                       "--cuda-graphs", "on", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["schedule"] for r in rows] == [*bench.SCHEDULES, "speculative k=4"]
    assert all(r["graphs"] and r["status"] == "eager_fallback" and r["decode_tok_per_s"] > 0 for r in rows)
    assert rows[0]["error"] and all(r["error"] == rows[0]["error"] for r in rows)  # e.g. no CUDA graph pool on CPU
