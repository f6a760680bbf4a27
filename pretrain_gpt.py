"""Pretrain a GPT model: the model provider, batches, loss and datasets; pretrain() does the rest.

    torchrun --nproc_per_node 8 pretrain_gpt.py <Megatron-LM flags>

See README.md and examples/ for complete command lines.
"""

from functools import partial

import torch

from megatron.core import parallel_state
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset
from megatron.core.enums import ModelType
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_layer_local_spec, get_gpt_layer_with_transformer_engine_spec,
)
from megatron.core.rerun_state_machine import get_rerun_state_machine
from megatron.core.utils import get_batch_on_this_cp_rank
from megatron.training import get_args, get_timers, get_tokenizer
from megatron.training.arguments import ArgumentError
from megatron.training.config_builders import core_transformer_config_from_args
from megatron.training.data_sources import DataSourceError, check_data_files, \
    get_blend_and_blend_per_split
from megatron.training.training import pretrain
from megatron.training.utils import print_rank_0


def model_provider(pre_process: bool = True, post_process: bool = True) -> GPTModel:
    """This rank's chunk of the GPT (``pre_process``: owns the embedding; ``post_process``:
    the output layer and the loss)."""
    args = get_args()
    print_rank_0("building GPT model ...")
    config = core_transformer_config_from_args(args)
    if args.transformer_impl == "local":
        spec = get_gpt_layer_local_spec(qk_layernorm=args.qk_layernorm)
    else:
        spec = get_gpt_layer_with_transformer_engine_spec(qk_layernorm=args.qk_layernorm)
    return GPTModel(
        config=config, transformer_layer_spec=spec, vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings, pre_process=pre_process,
        post_process=post_process, parallel_output=True,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type,
        rotary_percent=args.rotary_percent, rotary_base=args.rotary_base,
        rope_scaling=args.use_rope_scaling, rope_scaling_factor=args.rope_scaling_factor,
        seq_len_interpolation_factor=args.rotary_seq_len_interpolation_factor)


def get_batch(data_iterator):
    """The microbatch's tensors on the device; None on stages that read no data."""
    if not (parallel_state.is_pipeline_first_stage() or parallel_state.is_pipeline_last_stage()):
        return None, None, None, None, None
    batch = next(data_iterator)
    device = torch.cuda.current_device() if get_args().distributed_backend == "nccl" else "cpu"
    batch = get_batch_on_this_cp_rank(
        {key: value.to(device, non_blocking=True) for key, value in batch.items()})
    return (batch["tokens"], batch["labels"], batch["loss_mask"], batch.get("attention_mask"),
            batch["position_ids"])


# --check-for-spiky-loss: a local loss this many times the largest of its first 100 values.
SPIKY_LOSS_FACTOR = 10


def _validate_loss(loss_sum: torch.Tensor) -> None:
    """This rank's loss, before any reduction, through the rerun state machine: NaN is fatal
    (what that does: --rerun-mode), a spike is reported."""
    args = get_args()
    machine = get_rerun_state_machine()
    if args.check_for_nan_in_loss_and_grad:
        machine.validate_result(
            result=loss_sum, rejection_func=torch.isnan, tolerance=0.0, fatal=True,
            message="found NaN in local forward loss calculation (look at the batch this "
                    "rank read and at the learning rate; --no-check-for-nan-in-loss-and-grad "
                    "turns the check off)")
    if args.check_for_spiky_loss:
        machine.validate_result(
            result=loss_sum, message="Spiky loss", tolerance=0.0, fatal=False,
            rejection_func=partial(machine.is_unexpectedly_large, threshold=SPIKY_LOSS_FACTOR,
                                   context="loss"))


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """The loss over the tokens that count: their mean, or with --calculate-per-token-loss their
    sum and count (the schedule then divides by the global batch's tokens). The report is the
    sum and count, as upstream's, so the logged loss is the mean over the global batch's
    tokens.

    With context parallelism this rank holds part of each sequence: the mean divides by the
    count over the context-parallel group, times its size because data-parallel gradient
    averaging divides by data x context ranks; per token, each rank's own sum and count are
    right as they are (the gradients and counts are summed over both)."""
    losses = output_tensor.float().view(-1)
    mask = loss_mask.view(-1).float()
    loss_sum = torch.sum(losses * mask)
    count = mask.sum()
    cp_size = parallel_state.get_context_parallel_world_size()
    _validate_loss(loss_sum)
    report = {"lm loss": torch.stack([loss_sum.detach(), count])}
    if get_args().calculate_per_token_loss:
        return loss_sum, count.to(torch.int), report
    if cp_size > 1:
        sequence_count = count.clone()
        torch.distributed.all_reduce(sequence_count,
                                     group=parallel_state.get_context_parallel_group())
        return loss_sum * cp_size / sequence_count.clamp(min=1.0), report
    return loss_sum / count.clamp(min=1.0), report


def forward_step(data_iterator, model: GPTModel):
    timers = get_timers()
    timers("batch-generator", log_level=2).start()
    tokens, labels, loss_mask, attention_mask, position_ids = get_batch(data_iterator)
    timers("batch-generator").stop()
    output_tensor = model(tokens, position_ids, attention_mask, labels=labels)
    return output_tensor, partial(loss_func, loss_mask)


def is_dataset_built_on_rank() -> bool:
    return (parallel_state.is_pipeline_first_stage(ignore_virtual=True)
            or parallel_state.is_pipeline_last_stage(ignore_virtual=True))


def core_gpt_dataset_config_from_args(args) -> GPTDatasetConfig:
    blend, blend_per_split = get_blend_and_blend_per_split(args)
    return GPTDatasetConfig(
        random_seed=args.seed, sequence_length=args.seq_length, blend=blend,
        blend_per_split=blend_per_split,
        split=args.split or ("969,30,1" if blend is not None else None),
        num_dataset_builder_threads=args.num_dataset_builder_threads,
        path_to_cache=args.data_cache_path, mmap_bin_files=args.mmap_bin_files,
        tokenizer=get_tokenizer(), reset_position_ids=args.reset_position_ids,
        reset_attention_mask=args.reset_attention_mask, eod_mask_loss=args.eod_mask_loss,
        # Attention is causal without a mask (the model drops a merely causal one), so the
        # loader builds only masks that say more: documents kept apart.
        create_attention_mask=(args.create_attention_mask_in_dataloader
                               and args.reset_attention_mask),
        pack_sequences=not args.variable_seq_lengths)


def train_valid_test_datasets_provider(train_val_test_num_samples):
    args = get_args()
    dataset_type = MockGPTDataset if args.mock_data else GPTDataset
    if args.reset_attention_mask and not args.create_attention_mask_in_dataloader:
        print_rank_0("note: --no-create-attention-mask-in-dataloader: no attention mask is built, "
                     "so --reset-attention-mask has no effect (attention crosses documents), as "
                     "upstream")
    print_rank_0("> building train, validation, and test datasets for GPT ...")
    return BlendedMegatronDatasetBuilder(dataset_type, train_val_test_num_samples,
                                         is_dataset_built_on_rank,
                                         core_gpt_dataset_config_from_args(args)).build()


def check_data_before_training(args) -> None:
    """Where this rank reads the data, its files exist: a wrong --data-path ends the run at
    start-up in one line naming the flag, not after the model is built."""
    if not args.mock_data and is_dataset_built_on_rank():
        try:
            check_data_files(args)
        except DataSourceError as error:
            raise ArgumentError(str(error)) from None


if __name__ == "__main__":
    train_valid_test_datasets_provider.is_distributed = True
    train_valid_test_datasets_provider.preflight = check_data_before_training
    pretrain(train_valid_test_datasets_provider, model_provider, ModelType.encoder_or_decoder,
             forward_step, args_defaults={"tokenizer_type": "GPT2BPETokenizer"})
