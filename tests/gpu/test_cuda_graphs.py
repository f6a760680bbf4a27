"""CUDA graphs of the layers on one GPU (skipped without CUDA): the graph-safe RNG tracker draws
what the copying one draws, a fork captured in a graph draws afresh on each replay in the eager
order, and a GPT trained with ``enable_cuda_graph`` (dropout in attention and after each
sublayer, several lengths, two microbatches in flight: the first replayed, the second eager)
matches the eager model. On an H100 (2026-12-05) that last test's capture was invalidated
twice: with a microbatch in flight, and (captures then waiting for none) by the previous step's
loss, kept by the loop: both kept the parameters' gradient accumulators alive on the compute
stream. Captures now differentiate aliases of the parameters."""

import pytest
import torch

from megatron.core.tensor_parallel import random as tp_random
from megatron.core.transformer.cuda_graphs import CudaGraphs
from tests.support.gpt_support import batch, build_gpt, small_config

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def seeded(graph_safe: bool, seed: int = 11):
    tp_random.model_parallel_cuda_manual_seed(seed, use_cudagraphable_rng=graph_safe)
    return tp_random.get_cuda_rng_tracker()


def draws(tracker, count: int = 3) -> list[torch.Tensor]:
    out = []
    for _ in range(count):
        with tracker.fork():
            out.append(torch.rand(8, device="cuda"))
        out.append(torch.rand(8, device="cuda"))  # the default stream in between
    return out


def test_the_graph_safe_tracker_draws_and_saves_as_the_copying_one():
    copying = draws(seeded(False))
    states = tp_random.get_cuda_rng_tracker().get_states()
    tracker = seeded(True)
    assert isinstance(tracker, tp_random.GraphSafeRNGStatesTracker)
    assert all(torch.equal(a, b) for a, b in zip(draws(tracker), copying))
    saved = tracker.get_states()
    assert {n: s.tolist() for n, s in saved.items()} == {n: s.tolist() for n, s in states.items()}
    generators = tracker.generators()
    after = draws(tracker, 1)[0]
    tracker.set_states(saved)
    assert tracker.generators() == generators  # loaded in place: captured graphs keep them
    assert torch.equal(draws(tracker, 1)[0], after)


def test_a_captured_fork_draws_afresh_on_each_replay_in_the_eager_order():
    eager = draws(seeded(True), 2)
    tracker = seeded(True)
    static = torch.empty(2, 8, device="cuda")

    def body():
        with tracker.fork():
            static[0].copy_(torch.rand(8, device="cuda"))
        static[1].copy_(torch.rand(8, device="cuda"))
        return [static]

    replay, _ = CudaGraphs().capture(body, torch.cuda.graph_pool_handle())
    replayed = []
    for _ in range(2):
        replay()
        replayed += [static[0].clone(), static[1].clone()]
    assert all(torch.equal(a, b) for a, b in zip(replayed, eager))


def test_a_graphed_gpt_with_dropout_trains_as_the_eager_one():
    overrides = dict(hidden_dropout=0.1, attention_dropout=0.1)
    torch.manual_seed(0)
    plain = build_gpt(small_config(**overrides)).cuda()
    graphed = build_gpt(small_config(**overrides, enable_cuda_graph=True,
                                     cuda_graph_warmup_steps=1)).cuda()
    graphed.load_state_dict(plain.state_dict())
    worst = 0.0
    for model in (plain, graphed):
        seeded(True)
        model.losses = []
        for step, lengths in enumerate([(12, 12), (12, 10), (10, 12), (12, 12)]):
            # Two microbatches in flight, then their backwards.
            losses = []
            for k, length in enumerate(lengths):
                tokens, positions, labels = (t.cuda() for t in batch(seq=length, seed=10 * step + k))
                losses.append(model(tokens, positions, None, labels=labels).mean())
            for loss in reversed(losses):
                loss.backward()
            model.losses += [loss.item() for loss in losses]
    for a, b in zip(plain.losses, graphed.losses):
        worst = max(worst, abs(a - b) / abs(a))
    grad_worst = max((a.grad - b.grad).abs().max().item()
                     for a, b in zip(plain.parameters(), graphed.parameters()))
    print(f"graphed GPT against eager: losses within {worst:.2e}, gradients within {grad_worst:.2e}")
    assert worst <= 1e-6 and grad_worst <= 1e-6
    assert all(layer.cudagraph_manager.runners for layer in graphed.decoder.layers)
