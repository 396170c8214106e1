import dataclasses

import torch

from harness.run.experiment import DataSpec
from harness.workload import models
from harness.workload.data import make_batch
from harness.workload.loss import chunked_causal_lm_loss


def test_chunked_loss_equals_model_loss_and_grads():
    torch.manual_seed(0)
    spec = dataclasses.replace(models.get("qwen3-0.6b-tiny"), num_hidden_layers=2)
    m = models.build(spec, device="cpu", dtype=torch.float32, lora_rank=4)
    with torch.no_grad():
        for n, p in m.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.05)
    b = make_batch(DataSpec(distribution="lognormal", median_doc_len=20, seed=3), 96, 2, spec.vocab_size)
    ref = m(input_ids=b.input_ids, labels=b.labels, position_ids=b.position_ids, use_cache=False).loss
    ref.backward()
    ref_g = {n: p.grad.clone() for n, p in m.named_parameters() if p.requires_grad}
    m.zero_grad(set_to_none=True)
    got = chunked_causal_lm_loss(m, b.input_ids, b.labels, chunk_tokens=50, position_ids=b.position_ids)
    got.backward()
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
    for n, g in ref_g.items():
        torch.testing.assert_close(dict(m.named_parameters())[n].grad, g, rtol=1e-4, atol=1e-6, msg=n)
