"""benchmarks/bench_inference.py: a CPU toy run prints the table with every schedule row and writes its JSON."""

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
    expected = [(s, c, b) for c in (32, 64) for b in (1, 2)
                for s in bench.SCHEDULES + (("speculative k=4",) if b == 1 else ())]
    assert [(" ".join(r[:-8]), int(r[-8]), int(r[-7])) for r in rows] == expected
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
