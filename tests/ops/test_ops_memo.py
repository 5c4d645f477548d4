"""once_per_tensor: what the layers of a forward derive from the one modes tensor they share."""

import torch

from oryx_megatron.ops import once_per_tensor


def counted():
    calls = []

    @once_per_tensor
    def double(t, scale=2):
        calls.append(1)
        return t * scale

    return double, calls


def test_reused_for_the_same_unchanged_tensor_and_arguments_only():
    double, calls = counted()
    t = torch.arange(4)
    first = double(t)
    assert double(t) is first and len(calls) == 1
    assert torch.equal(double(t, 3), t * 3) and len(calls) == 2  # other arguments
    assert torch.equal(double(t.clone()), t * 2) and len(calls) == 3  # equal values, another tensor
    double(t)
    t.add_(1)  # changed in place: its version moved on
    assert torch.equal(double(t), torch.arange(1, 5) * 2) and len(calls) == 5


def test_inference_tensors_are_computed_every_time():
    double, calls = counted()
    with torch.inference_mode():
        t = torch.arange(4)
        double(t), double(t)
    assert len(calls) == 2


def test_tensor_arguments_count_by_identity_and_version():
    calls = []

    @once_per_tensor
    def masked(t, mask, scale):
        calls.append(1)
        return t * mask * scale

    t, mask = torch.arange(4), torch.tensor([1, 0, 1, 0])
    first = masked(t, mask, 2)
    assert masked(t, mask, 2) is first and len(calls) == 1
    masked(t, mask.clone(), 2)  # equal values, another tensor: no comparison of values (and no error)
    assert len(calls) == 2
    again = masked(t, mask, 2)
    assert masked(t, mask, 2) is again and len(calls) == 3
    mask.mul_(2)  # the argument changed in place
    assert torch.equal(masked(t, mask, 2), t * mask * 2) and len(calls) == 4
