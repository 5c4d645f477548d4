import dataclasses
import multiprocessing
from concurrent.futures import ProcessPoolExecutor

import numpy as np
import pytest

from oryx_megatron.config import Mode
from oryx_megatron.data.modes import (
    SCHEDULES, all_attention, all_linear, build_mode_schedule, explicit, linear_then_attention, random_chunks,
    switch_at,
)


def test_random_chunks_respect_chunk_boundaries():
    schedule = random_chunks(chunk_size=16, p_attention=0.5)
    for index in range(50):
        modes = schedule.sample_modes(100, index, seed=3)
        assert modes.dtype == np.int8 and modes.shape == (100,)
        chunks = np.split(modes, range(16, 100, 16))  # the last chunk is partial
        assert all((c == c[0]).all() for c in chunks)
    # A shorter sequence gets a prefix of a longer one's modes.
    assert (schedule.sample_modes(100, 7, 3) == schedule.sample_modes(300, 7, 3)[:100]).all()


@pytest.mark.parametrize("p", [0.0, 0.1, 0.5, 0.9, 1.0])
def test_random_chunks_honour_p_attention(p):
    schedule = random_chunks(chunk_size=8, p_attention=p)
    draws = np.stack([schedule.sample_modes(64, i, seed=11)[::8] for i in range(4000)])  # one entry per chunk
    n = draws.size
    assert abs(draws.mean() - p) <= 5 * np.sqrt(p * (1 - p) / n) + 1e-12


def test_random_chunks_depend_on_seed_and_index_only():
    schedule = random_chunks(chunk_size=4)
    a = schedule.batch(64, range(10), seed=1)
    assert (a.numpy() == schedule.batch(64, range(10), seed=1).numpy()).all()
    assert (a[3].numpy() == schedule.sample_modes(64, 3, seed=1)).all()
    assert not (a.numpy() == schedule.batch(64, range(10), seed=2).numpy()).all()
    assert len({tuple(row) for row in a.tolist()}) > 1


def _modes_in_fresh_process(indices):
    return build_mode_schedule({"name": "random_chunks", "chunk_size": 32, "p_attention": 0.3}).batch(256, indices, 5).numpy()


def test_two_ranks_compute_the_same_modes_independently():
    with ProcessPoolExecutor(2, mp_context=multiprocessing.get_context("spawn")) as pool:
        rank0, rank1 = pool.map(_modes_in_fresh_process, [range(100, 140)] * 2)
    assert (rank0 == rank1).all()
    assert (rank0 == _modes_in_fresh_process(range(100, 140))).all()


def test_named_schedules_give_their_patterns():
    assert (all_attention().sample_modes(10) == Mode.ATTENTION).all()
    assert (all_linear().sample_modes(10) == Mode.LINEAR).all()
    assert linear_then_attention(3).sample_modes(8).tolist() == [0, 0, 0, 0, 0, 1, 1, 1]
    assert linear_then_attention(20).sample_modes(4).tolist() == [1, 1, 1, 1]
    assert switch_at(2, "attention", "linear").sample_modes(5).tolist() == [1, 1, 0, 0, 0]
    assert switch_at(9).sample_modes(4).tolist() == [0, 0, 0, 0]
    assert explicit([0, 1, "attention"], chunk_size=3).sample_modes(8).tolist() == [0, 0, 0, 1, 1, 1, 1, 1]
    for schedule in (all_attention(), switch_at(3), explicit([1, 0], 4)):
        assert schedule.sample_modes(8).dtype == np.int8
        assert (schedule.sample_modes(8, 0, 0) == schedule.sample_modes(8, 99, 7)).all()  # deterministic schedules ignore both


def test_explicit_too_short_for_the_sequence():
    with pytest.raises(ValueError, match="covers 2 chunks x 4 = 8 tokens, shorter than seq_len 9"):
        explicit([1, 0], 4).sample_modes(9)


def test_build_from_configs():
    assert build_mode_schedule(None) == random_chunks(chunk_size=128, p_attention=0.5)
    assert build_mode_schedule("all_linear") == all_linear()
    assert build_mode_schedule({"name": "switch_at", "t": 4, "before": 1, "after": 0}) == switch_at(4, 1, 0)
    assert build_mode_schedule({"name": "explicit", "chunk_modes": [1, 0], "chunk_size": 2}) == explicit((1, 0), 2)

    @dataclasses.dataclass
    class Config:
        name: str = "linear_then_attention"
        n_last: int = 16

    assert build_mode_schedule(Config()) == linear_then_attention(16)


def test_text_form_round_trips():
    """str(schedule) is the text form build_mode_schedule reads (the inference CLI's too)."""
    assert build_mode_schedule("linear_then_attention n_last=16") == linear_then_attention(16)
    assert build_mode_schedule("switch_at t=4, before=attention after=0") == switch_at(4, 1, 0)
    assert build_mode_schedule("explicit chunk_modes=[0, 1, attention] chunk_size=2") == explicit((0, 1, 1), 2)
    assert build_mode_schedule("random_chunks p_attention=0.25") == random_chunks(p_attention=0.25)
    assert str(all_attention()) == "all_attention"
    assert str(switch_at(4)) == "switch_at t=4 before=linear after=attention"
    for schedule in (all_attention(), all_linear(), random_chunks(16, 0.3), switch_at(4, 1, 0),
                     linear_then_attention(3), explicit([1, 0, 1], 8)):
        assert build_mode_schedule(str(schedule)) == schedule
    assert set(SCHEDULES) == {"random_chunks", "all_attention", "all_linear", "switch_at", "linear_then_attention",
                              "explicit"}


@pytest.mark.parametrize("config, message", [
    ({"name": "random"}, "mode schedule name 'random' is unknown; choose one of random_chunks, "),
    ({"chunk_size": 4}, "mode schedule name None is unknown"),
    ({"name": "random_chunks", "chunk": 4}, "'random_chunks' has no field 'chunk'; its fields are: chunk_size, p_attention"),
    ({"name": "random_chunks", "p_attention": 1.5}, r"random_chunks.p_attention must be in \[0, 1\], got 1.5"),
    ({"name": "random_chunks", "chunk_size": 0}, "random_chunks.chunk_size must be an integer >= 1, got 0"),
    ({"name": "switch_at"}, "mode schedule 'switch_at' needs field 't'"),
    ({"name": "switch_at", "t": 3, "after": "mamba"}, "switch_at.after: unknown mode 'mamba'"),
    ({"name": "explicit", "chunk_modes": [0, 7]}, r"explicit.chunk_modes\[1\]: unknown mode 7"),
    ({"name": "explicit", "chunk_modes": []}, "explicit.chunk_modes must be a non-empty list"),
    ({"name": "linear_then_attention", "n_last": -1}, "linear_then_attention.n_last must be an integer >= 0"),
    ("all-attention", "mode schedule name 'all-attention' is unknown; choose one of random_chunks, all_attention, "
                      "all_linear, switch_at, linear_then_attention, explicit"),
    ("switch_at 5", "mode schedule 'switch_at 5': cannot read '5'; expected FIELD=VALUE"),
    ("switch_at t=5 t=6", "mode schedule 'switch_at t=5 t=6': 't' is given twice"),
    ("linear_then_attention n=4", "'linear_then_attention' has no field 'n'; its fields are: n_last"),
])
def test_bad_configs_name_the_field(config, message):
    with pytest.raises(ValueError, match=message):
        build_mode_schedule(config)
