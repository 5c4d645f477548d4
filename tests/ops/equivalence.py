"""Shared check: two computations agree in value and in gradients w.r.t. every leaf."""

import torch


def assert_same_values_and_grads(outputs, references, leaves: dict, tol: float = 1e-9) -> dict:
    """outputs/references: tuples of tensors computed from `leaves` (name -> leaf tensor).
    Compares values, then gradients of a random projection of the outputs; returns the
    reference gradients by leaf name."""
    for out, ref in zip(outputs, references):
        assert out.shape == ref.shape
        assert (out - ref).abs().max() < tol
    gen = torch.Generator().manual_seed(1)
    weights = [torch.randn(t.shape, generator=gen, dtype=t.dtype) for t in outputs]
    grads = torch.autograd.grad(sum((t * w).sum() for t, w in zip(outputs, weights)), list(leaves.values()))
    grads_ref = torch.autograd.grad(sum((t * w).sum() for t, w in zip(references, weights)), list(leaves.values()))
    for name, grad, grad_ref in zip(leaves, grads, grads_ref):
        assert (grad - grad_ref).abs().max() < tol, name
    return dict(zip(leaves, grads_ref))
