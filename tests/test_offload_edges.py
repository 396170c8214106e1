"""optim.offload's checkpoint at the edges a user's code reaches: a checkpoint inside a checkpointed
layer, tensors inside a positional tuple, a backward restricted to some leaves, and an offloader
closed between a forward and its backward. Each either matches torch's own checkpoint or fails
with one error that says what to do."""

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint as torch_checkpoint

import optim.offload as oo

pytestmark = pytest.mark.usefixtures("one_thread")

D = 32


class Block(nn.Module):
    """Reads its input again in the backward (the product), so a wrong reload changes gradients."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(D, D), nn.Linear(D, D)

    def forward(self, x, *rest):
        return x + self.b(torch.tanh(self.a(x))) * x


def _reference(f, *args, **kwargs):
    return torch_checkpoint(f, *args, use_reentrant=False, **kwargs)


def _grads(module):
    return [p.grad.clone() for p in module.parameters()]


def test_a_checkpoint_inside_a_checkpointed_layer_matches_torch_at_every_step():
    """The inner calls run during the outer layer's recompute, inside the backward: they start no
    new step and leave the outer layer's reloaded input in its staging buffer."""
    torch.manual_seed(0)
    outer = nn.ModuleList(Block() for _ in range(4))
    inner = nn.ModuleList(nn.ModuleList(Block() for _ in range(3)) for _ in range(4))
    params = nn.ModuleList([outer, inner])

    def step(ck, seed):
        params.zero_grad(set_to_none=True)
        h = torch.randn(16, D, generator=torch.Generator().manual_seed(seed))
        for o, ins in zip(outer, inner):
            def block(h, o=o, ins=ins):
                y = h * h
                for b in ins:
                    y = ck(b, y)
                return o(y)
            h = ck(block, h)
        h.square().mean().backward()
        return _grads(params)

    off = oo.Offloader("double", min_bytes=0)
    for seed in (0, 1):  # the first step and the next
        ref, got = step(_reference, seed), step(off, seed)
        assert all(torch.equal(a, b) for a, b in zip(got, ref)), seed
        assert off.stats()["offloaded"] == 3  # the outer layers' inputs (the last stays); none of the inner ones


def test_a_tensor_that_needs_grad_inside_a_positional_tuple_gets_its_gradient():
    w = torch.randn(D, requires_grad=True)

    class Scale(nn.Module):
        def forward(self, x, pair):
            return x * pair[0]

    def run(ck):
        w.grad = None
        h = torch.randn(4, D, generator=torch.Generator().manual_seed(6))
        c = w * 2  # not a leaf, and it needs a grad: autograd must see it
        for _ in range(3):
            h = ck(Scale(), h, (c,))
        h.sum().backward()
        return w.grad.clone()

    assert torch.equal(run(oo.Offloader("double", min_bytes=0)), run(_reference))


def test_a_backward_restricted_to_some_leaves_through_an_offloaded_layer_raises_one_clear_error():
    torch.manual_seed(0)
    blocks = nn.ModuleList(Block() for _ in range(3))
    off = oo.Offloader("double", min_bytes=0)

    def forward():
        x = torch.randn(8, D, generator=torch.Generator().manual_seed(1)).requires_grad_()
        h = x * 1.0
        for b in blocks:
            h = off(b, h)
        return x, h.square().mean()

    x, loss = forward()
    with pytest.raises(RuntimeError, match=r"restricted to some leaves .* Call loss.backward\(\), or enable with offload='none'"):
        torch.autograd.grad(loss, [x])
    x, loss = forward()
    with pytest.raises(RuntimeError, match="restricted to some leaves"):
        loss.backward(inputs=[x])
    blocks.zero_grad(set_to_none=True)
    x, loss = forward()
    loss.backward()  # the plain backward after them still trains every layer
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in blocks.parameters())
    assert x.grad is not None


def test_an_offloader_closed_before_the_backward_says_so():
    torch.manual_seed(0)
    blocks = nn.ModuleList(Block() for _ in range(3))
    off = oo.Offloader("double", min_bytes=0)
    h = torch.randn(8, D, requires_grad=True) * 1.0
    for b in blocks:
        h = off(b, h)
    assert off.stats()["offloaded"] == 2
    off.close()
    with pytest.raises(RuntimeError, match="closed .* before its backward ran"):
        h.sum().backward()
