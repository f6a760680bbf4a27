"""--cross-entropy-loss-fusion: the fused loss against the plain vocab-parallel one (one rank;
tests/distributed/tensor_parallel_cases.py holds it at tp 2 and 4, tests/gpu its compiled
kernels in training)."""

from __future__ import annotations

import pytest
import torch

from megatron.core import tensor_parallel as tp
from megatron.core.fusions.fused_cross_entropy import fused_vocab_parallel_cross_entropy


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_loss_and_gradient_equal_the_plain_ones(dtype):
    generator = torch.Generator().manual_seed(3)
    logits = (6 * torch.randn(5, 3, 37, generator=generator)).to(dtype)
    target = torch.randint(0, 37, (5, 3), generator=generator)
    weights = torch.rand(5, 3, generator=generator)
    plain = logits.clone().requires_grad_()
    fused = logits.clone().requires_grad_()
    expected = tp.vocab_parallel_cross_entropy(plain, target)
    loss = fused_vocab_parallel_cross_entropy(fused, target)
    assert loss.dtype == torch.float32 and loss.shape == (5, 3)
    torch.testing.assert_close(loss, expected)
    (expected * weights).sum().backward()
    (loss * weights).sum().backward()
    assert fused.grad.dtype == dtype
    torch.testing.assert_close(fused.grad, plain.grad)
    assert torch.equal(fused.detach(), logits)  # the caller's logits are left as they were


def test_fused_loss_rejects_a_target_of_another_shape():
    with pytest.raises(ValueError, match="target shape"):
        fused_vocab_parallel_cross_entropy(torch.randn(2, 1, 5), torch.zeros(2, dtype=torch.long))


def test_gpt_model_with_the_fusion_flag_trains_as_without():
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    def loss_and_grads(fusion: bool):
        torch.manual_seed(0)
        config = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4,
                                   hidden_dropout=0.0, attention_dropout=0.0,
                                   cross_entropy_loss_fusion=fusion)
        model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(),
                         vocab_size=64, max_sequence_length=16)
        tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
        positions = torch.arange(16).expand(2, 16)
        loss = model(tokens, positions, None, labels=tokens.roll(-1, dims=1)).mean()
        loss.backward()
        return loss.detach(), {name: p.grad for name, p in model.named_parameters()}

    plain_loss, plain_grads = loss_and_grads(False)
    fused_loss, fused_grads = loss_and_grads(True)
    torch.testing.assert_close(fused_loss, plain_loss)
    for name, grad in plain_grads.items():
        torch.testing.assert_close(fused_grads[name], grad, msg=name)
