"""A packed training step on CPU and the comparison of two, shared by the packing and regional
tests: loss and gradients of one step over documents of ``lengths`` (ids drawn from ``seed``)."""

import torch

import optim.packing as P


def packed_step(model, lengths, seed: int = 0):
    """One forward + backward on packed rows of ``lengths``: (loss, {name: grad})."""
    meta = P.PackedMetadata.from_lengths(lengths)
    ids = torch.randint(0, 100, (meta.batch_size, meta.seq_len), generator=torch.Generator().manual_seed(seed))
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids, position_ids=meta.position_ids(), use_cache=False,
                 **P.packed_kwargs(meta)).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_same_step(got, ref):
    """fp32: the loss to 1e-5 and every gradient (LoRA's among them) to 1e-4, relative."""
    (lg, gg), (lr, gr) = got, ref
    torch.testing.assert_close(lg, lr, rtol=1e-5, atol=1e-6)
    assert gg.keys() == gr.keys() and any("lora_A" in k for k in gr)
    for k in gr:
        torch.testing.assert_close(gg[k], gr[k], rtol=1e-4, atol=1e-6, msg=k)
