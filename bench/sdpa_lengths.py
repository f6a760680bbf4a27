"""What a sequence length never seen before costs on one GPU, against the same length again.

    python bench/sdpa_lengths.py

Causal ``scaled_dot_product_attention`` forward+backward at the bench's attention shape (batch
4, 16 heads, head dim 128, bf16) over eight new lengths in [1031, 2000], each timed the first
time and again, for torch's default choice of kernel (cuDNN on an H100/H200, which builds plans
per shape), then restricted to cuDNN, flash and memory-efficient attention. The restricted rows
run after the default one on the same lengths, so their "first-seen" times show plans already
made. Then a compiled pointwise fusion (``pointwise_fusion``, as the model's bias-GeLU) on new
shapes: the first compiles, the second recompiles for dynamic shapes, later ones reuse that.
Ends with the ratio line for the default kernel. This is why ``--variable-seq-length-multiple``
rounds lengths on GPUs.
"""

import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron.core.fusions.compiled import pointwise_fusion  # noqa: E402

LENGTHS = [1031, 1297, 1500, 1777, 1901, 2000, 1111, 1640]


def timed_ms(fn) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e3


def attention_step(length: int) -> None:
    q, k, v = (torch.randn(4, 16, length, 128, device="cuda", dtype=torch.bfloat16,
                           requires_grad=True) for _ in range(3))
    F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()


@pointwise_fusion
def bias_gelu(x, bias):
    return F.gelu(x + bias, approximate="tanh")


def main() -> int:
    torch.manual_seed(0)
    default = None
    for name, backend in [("default", None), ("cudnn", SDPBackend.CUDNN_ATTENTION),
                          ("flash", SDPBackend.FLASH_ATTENTION),
                          ("efficient", SDPBackend.EFFICIENT_ATTENTION)]:
        with sdpa_kernel(backend) if backend else torch.autograd.graph.saved_tensors_hooks(
                lambda x: x, lambda x: x):
            attention_step(2048)
            attention_step(2048)
            firsts, agains = [], []
            for length in LENGTHS:
                firsts.append(timed_ms(lambda: attention_step(length)))
                agains.append(timed_ms(lambda: attention_step(length)))
            first, again = sum(firsts) / len(firsts), sum(agains) / len(agains)
            default = default or (first, again)
            print(f"{name:10s} first-seen length fwd+bwd {first:8.2f} ms, again {again:6.2f} ms; "
                  f"2048: {timed_ms(lambda: attention_step(2048)):.2f} ms", flush=True)
    bias = torch.randn(8192, device="cuda", dtype=torch.bfloat16)
    for length in [2048, 1031, 1297, 1500, 1777]:
        x = torch.randn(length, 4, 8192, device="cuda", dtype=torch.bfloat16)
        print(f"compiled pointwise {length}: {timed_ms(lambda: bias_gelu(x, bias)):.1f} ms first, "
              f"{timed_ms(lambda: bias_gelu(x, bias)):.2f} ms again", flush=True)
    print(f"default attention, first-seen/again time per length = {default[0] / default[1]:.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
