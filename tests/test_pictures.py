"""The pictures the commands write say what they are for: the loss curve keeps counters off the loss
axis; the mode-switch figure draws each switched schedule against its target mode, smoothed on each side
of the switch, and their gap with the convergence band (the raw curves stay in the CSV)."""

import numpy as np

from oryx_megatron.eval import mode_switch
from oryx_megatron.training.metrics import COUNTERS, loss_curve_figure


def labels(ax) -> set:
    return {line.get_label() for line in ax.get_lines()}


def test_the_loss_curve_draws_counters_on_their_own_axis():
    history = [{"iteration": i, "train/loss": 5.0 - 0.01 * i, "train/loss_attention": 4.9, "train/loss_linear": 5.1,
                "train/loss_spikes": int(i == 7), "train/skipped_steps": 0} for i in range(1, 21)]
    history.append({"iteration": 20, "eval/loss_all_attention": 4.8})
    losses, counters = loss_curve_figure(history).axes
    assert labels(losses) == {"train/loss", "train/loss_attention", "train/loss_linear", "eval/loss_all_attention"}
    assert labels(counters) == {"train/loss_spikes"}  # skipped_steps: all 0, nothing drawn
    assert losses.get_ylim()[0] > 4  # no count pinned at 0 squeezes the losses
    assert set(COUNTERS) == {"train/loss_spikes", "train/skipped_steps"}
    assert loss_curve_figure([{"iteration": 1, "perf/mfu": 0.1}]) is None


def test_the_mode_switch_figure_draws_each_switch_against_its_target_smoothed():
    s, t, width = 64, 32, 8
    step = np.where(np.arange(s) < t, 1.0, 3.0)  # every curve jumps at the switch
    curves = {"all_attention": step, "all_linear": step + 1, "attention_to_linear": np.where(step < 2, 1.0, 4.5),
              "linear_to_attention": step + 0.25}
    assert np.array_equal(mode_switch.centered(step, t, width), step)  # no point mixes both sides of the switch
    noisy = step + np.random.default_rng(0).normal(0, 1, s)
    assert np.std(np.diff(mode_switch.centered(noisy, t, width))) < 0.5 * np.std(np.diff(noisy))
    gap = mode_switch.gap_to_target(curves, t, "attention_to_linear", "all_linear", width)
    assert np.allclose(gap[:t], -1.0) and np.allclose(gap[t:], 0.5)  # switched minus target, each side alone
    rows = [dict(switch="attention_to_linear", tokens_to_converge=1), dict(switch="linear_to_attention",
                                                                           tokens_to_converge=None)]
    fig = mode_switch.switch_figure(curves, t, width, rows, tolerance_nats=0.1)
    (first, second), (first_gap, _) = np.reshape(fig.axes, (2, 2))
    assert labels(first) == {"all attention", "all linear", "attention to linear", "switch at 32"}
    assert first.get_title() == "attention → linear: within the band 1 token after the switch"
    assert second.get_title() == "linear → attention: not within the band by the end"
    switched = next(line for line in first.get_lines() if line.get_label() == "attention to linear")
    assert np.array_equal(switched.get_ydata(), curves["attention_to_linear"])
    drawn = {line.get_label(): line.get_ydata() for line in first_gap.get_lines()}
    assert np.array_equal(drawn["attention to linear − all linear"], gap)
    assert np.allclose(drawn["all attention − all linear"], -1.0)  # the gap the switch closes
    routed = mode_switch.switch_figure({**curves, "router budget=0.1": step}, t, width, rows, 0.1)
    assert len(routed.axes) == 6 and "router budget=0.1" in labels(routed.axes[2])
