"""optim.graphs without a GPU: what cannot be captured is refused before any capture, with a
message that says what to change. The capture itself runs in tests/test_gpu_graphs.py."""

import pytest
import torch

from harness.workload import models
from optim import graphs


@pytest.fixture(scope="module")
def model():
    return models.build(models.get("llama-3.2-1b-tiny"), device="cpu", dtype=torch.float32, lora_rank=2,
                        checkpoint_preserve_rng=False)


def _adamw(model, **kw):
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], **kw)


def test_an_optimizer_without_capturable_is_refused(model):
    with pytest.raises(graphs.CaptureError, match="capturable=True"):
        graphs.check_capturable(model, _adamw(model))
    graphs.check_capturable(model, _adamw(model, capturable=True))


def test_dropout_in_training_is_refused(model):
    lora = model.get_base_model().model.layers[0].self_attn.q_proj
    old = lora.lora_dropout["default"]
    lora.lora_dropout["default"] = torch.nn.Dropout(0.1)
    try:
        with pytest.raises(graphs.CaptureError, match="Dropout with p=0.1"):
            graphs.check_capturable(model, _adamw(model, capturable=True))
        model.eval()  # no dropout runs in eval mode: nothing to refuse
        graphs.check_capturable(model, _adamw(model, capturable=True))
    finally:
        model.train()
        lora.lora_dropout["default"] = old


def test_capture_paths_flips_transformers_mask_checks_and_restores_them():
    import transformers.masking_utils as mu

    before = mu.is_tracing
    with graphs.capture_paths():
        assert mu.is_tracing(torch.zeros(1)) is True
    assert mu.is_tracing is before and mu.is_tracing(torch.zeros(1)) is False


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_graphed_step_without_cuda_says_so(model):
    with pytest.raises(graphs.CaptureError, match="needs a CUDA device"):
        graphs.GraphedStep(lambda: torch.zeros(()), _adamw(model, capturable=True))
