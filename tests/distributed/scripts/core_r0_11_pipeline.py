"""A pipeline-parallel training step written against megatron.core 0.11's public API only.

Nothing here is specific to this tree: the imports, initialize_model_parallel, the config
(with the hidden_size attribute 0.11's pipelined schedules read), chunks built under
set_virtual_pipeline_model_parallel_rank with set_input_tensor, and get_forward_backward_func.
Run with torchrun on gloo (CPU tensors) or, with ``--backend nccl``, on the GPU of
``LOCAL_RANK``; every rank checks its gradients (and the last rank its losses) against the
whole stack computed in one process on the same device, and exits non-zero when the largest
relative difference exceeds ``--tolerance``.

    torchrun --nproc_per_node 2 core_r0_11_pipeline.py --vpp 2 --variable-seq-lengths
"""

import argparse
import json
import os
from functools import partial

import torch
import torch.distributed

from megatron.core import ModelParallelConfig, parallel_state
from megatron.core.enums import ModelType
from megatron.core.pipeline_parallel import get_forward_backward_func

HIDDEN, SEQ, MBS = 16, 12, 2


class Layer(torch.nn.Module):
    def __init__(self, index):
        super().__init__()
        torch.manual_seed(index)
        self.linear = torch.nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x):
        return x + torch.tanh(self.linear(x))


class ModelChunk(torch.nn.Module):
    def __init__(self, config, first_layer, num_layers):
        super().__init__()
        self.config = config
        self.model_type = ModelType.encoder_or_decoder
        self.pre_process = parallel_state.is_pipeline_first_stage()
        self.post_process = parallel_state.is_pipeline_last_stage()
        self.layers = torch.nn.ModuleList(Layer(first_layer + i) for i in range(num_layers))
        self.input_tensor = None

    def set_input_tensor(self, input_tensor):
        self.input_tensor = input_tensor[0] if isinstance(input_tensor, list) else input_tensor

    def forward(self, tokens):
        h = tokens if self.pre_process else self.input_tensor
        for layer in self.layers:
            h = layer(h)
        return h


def data(num_microbatches, variable, device):
    gen = torch.Generator().manual_seed(7)
    batches = []
    for _ in range(num_microbatches):
        s = int(torch.randint(2, SEQ + 1, (1,), generator=gen)) if variable else SEQ
        batches.append((torch.randn(s, MBS, HIDDEN, generator=gen).to(device),
                        torch.randn(s, MBS, HIDDEN, generator=gen).to(device)))
    return batches


def loss_func(labels, output_tensor):
    loss = torch.nn.functional.mse_loss(output_tensor, labels)
    return loss, {"lm loss": loss.detach()}


def forward_step_func(data_iterator, model):
    tokens, labels = next(data_iterator)
    return model(tokens), partial(loss_func, labels)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--vpp", type=int, default=None)
    parser.add_argument("--layers-per-chunk", type=int, default=2)
    parser.add_argument("--num-microbatches", type=int, default=8)
    parser.add_argument("--variable-seq-lengths", action="store_true")
    parser.add_argument("--no-batch-p2p-comm", action="store_true")
    parser.add_argument("--overlap-p2p-comm", action="store_true",
                        help="overlap_p2p_comm=True (which implies batch_p2p_comm=False)")
    parser.add_argument("--backend", choices=("gloo", "nccl"), default="gloo")
    parser.add_argument("--tolerance", type=float, default=1e-6,
                        help="largest relative difference from the reference that passes")
    args = parser.parse_args()

    device = torch.device("cpu")
    if args.backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        device = torch.device("cuda", torch.cuda.current_device())
    torch.distributed.init_process_group(backend=args.backend)
    pp = torch.distributed.get_world_size()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=1, pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=args.vpp)
    config = ModelParallelConfig(
        pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=args.vpp,
        pipeline_dtype=torch.float32, variable_seq_lengths=args.variable_seq_lengths,
        batch_p2p_comm=not (args.no_batch_p2p_comm or args.overlap_p2p_comm),
        overlap_p2p_comm=args.overlap_p2p_comm)
    config.hidden_size = HIDDEN

    rank = parallel_state.get_pipeline_model_parallel_rank()
    num_chunks = args.vpp or 1
    model = []
    for chunk in range(num_chunks):
        if args.vpp is not None:
            parallel_state.set_virtual_pipeline_model_parallel_rank(chunk)
        stage = chunk * pp + rank
        model.append(ModelChunk(config, stage * args.layers_per_chunk,
                                args.layers_per_chunk).to(device))

    batches = data(args.num_microbatches, args.variable_seq_lengths, device)
    forward_backward_func = get_forward_backward_func()
    losses = forward_backward_func(
        forward_step_func=forward_step_func,
        data_iterator=[iter(batches) for _ in model] if args.vpp else iter(batches),
        model=model if args.vpp else model[0],
        num_microbatches=args.num_microbatches, seq_length=SEQ, micro_batch_size=MBS,
        decoder_seq_length=SEQ, forward_only=False)

    # The same stack in one process.
    total_layers = pp * num_chunks * args.layers_per_chunk
    reference = torch.nn.ModuleList(Layer(i) for i in range(total_layers)).to(device)
    ref_losses = []
    for tokens, labels in batches:
        h = tokens
        for layer in reference:
            h = layer(h)
        loss = torch.nn.functional.mse_loss(h, labels)
        (loss / args.num_microbatches).backward()
        ref_losses.append(float(loss))

    worst = 0.0
    for chunk, module in enumerate(model):
        stage = chunk * pp + rank
        for i, layer in enumerate(module.layers):
            ref = reference[stage * args.layers_per_chunk + i]
            for mine, theirs in zip(layer.parameters(), ref.parameters()):
                worst = max(worst, float((mine.grad - theirs.grad).abs().max()
                                         / theirs.grad.abs().max()))
    if parallel_state.is_pipeline_last_stage(ignore_virtual=True):
        for got, want in zip(losses, ref_losses):
            worst = max(worst, abs(float(got["lm loss"]) - want) / abs(want))
        assert len(losses) == args.num_microbatches
    print("RESULT " + json.dumps({"rank": torch.distributed.get_rank(), "worst": worst}),
          flush=True)
    torch.distributed.destroy_process_group()
    raise SystemExit(0 if worst <= args.tolerance else 1)


if __name__ == "__main__":
    main()
