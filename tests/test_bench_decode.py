"""benchmarks/bench_decode.py at a tiny size: every row of the Transformer (stock LlamaForCausalLM) and of Oryx-TG
(the pinned Hugging Face front end, in a subprocess) measures with the peer's greedy tokens equal to ours (the
benchmark asserts it), and the table names each row. No timing is asserted."""

import pytest

from benchmarks import bench_decode as bench

pytestmark = pytest.mark.usefixtures("single_process_parallel", "one_thread")


def test_a_tiny_run_prints_every_row_with_equal_tokens(capsys):
    assert bench.main(["--families", "transformer", "oryx_tg", "--batches", "1", "--prompt", "16",
                       "--new-tokens", "4", "--repeats", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].split() == list(bench.COLUMNS)
    rows = [line for line in lines[3:] if not line.startswith("missed")]
    names = [(r.split()[0], " ".join(r.split()[1:-9])) for r in rows]
    assert names == [("transformer", "all_attention")] + [("oryx_tg", s) for s in bench.SCHEDULES["oryx_tg"]]
