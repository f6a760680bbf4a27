"""Flags of parallelism and torch.distributed, with this tree's own start-up and p2p safety flags.

This tree's own: ``--distributed-startup-timeout-seconds``, ``--variable-seq-lengths`` (upstream
has the config field but forces it off), ``--variable-seq-length-multiple``,
``--overlap-p2p-communication``, ``--p2p-timeout-seconds``, ``--p2p-debug-tags``,
``--p2p-dump-dir``.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from megatron.core.transformer.context_parallel import CP_COMM_TYPES
from megatron.training.flags.schema import option, unavailable

_ENCODER = "separate encoder parallelism (T5, multimodal) is not implemented"


@dataclasses.dataclass
class DistributedArgs:
    tensor_model_parallel_size: int = option(1, "tensor model-parallel degree")
    encoder_tensor_model_parallel_size: int = unavailable(0, _ENCODER)
    pipeline_model_parallel_size: int = option(1, "pipeline model-parallel degree (stages)")
    encoder_pipeline_model_parallel_size: int = unavailable(0, _ENCODER)
    pipeline_model_parallel_split_rank: Optional[int] = unavailable(None, _ENCODER)
    decoder_first_pipeline_num_layers: Optional[int] = option(
        None, "layers of the first pipeline stage (the rest split evenly over the others)")
    decoder_last_pipeline_num_layers: Optional[int] = option(
        None, "layers of the last pipeline stage (the rest split evenly over the others)")
    model_parallel_size: Optional[int] = unavailable(
        None, "upstream removed it; use --tensor-model-parallel-size")
    num_layers_per_virtual_pipeline_stage: Optional[int] = option(
        None, "layers per virtual pipeline stage (interleaved schedule)")
    num_virtual_stages_per_pipeline_rank: Optional[int] = option(
        None, "virtual pipeline stages (model chunks) per pipeline rank (interleaved schedule)")
    microbatch_group_size_per_vp_stage: Optional[int] = option(
        None, "contiguous microbatches per virtual stage (default: pipeline size)",
        flags=("--microbatch-group-size-per-virtual-pipeline-stage",))
    overlap_p2p_comm: bool = option(
        True, "overlap pipeline p2p with compute (upstream's default); with "
              "--no-overlap-p2p-communication p2p calls are batched and blocking",
        flags=("--overlap-p2p-communication",), negative=("--no-overlap-p2p-communication",))
    overlap_p2p_comm_warmup_flush: bool = option(
        False, "", flags=("--overlap-p2p-communication-warmup-flush",), accepted="the overlapped schedule here already posts each receive one "
        "compute ahead in warm-up and flush too; needs the overlapped p2p (default)")
    distributed_backend: str = option("nccl", "torch.distributed backend",
                                      choices=("nccl", "gloo"))
    distributed_timeout_minutes: int = option(
        10, "timeout of collectives and p2p once training runs")
    # Later upstream's (not in core 0.11).
    use_gloo_process_groups: bool = option(
        True, "create gloo twins of the data-parallel groups, as megatron.core does by default "
        "(nothing in this tree's training uses them; --disable-gloo-process-groups leaves them "
        "out)", negative=("--disable-gloo-process-groups",))
    overlap_grad_reduce: bool = option(False, "overlap the data-parallel gradient reduction "
                                       "with the backward pass")
    defer_embedding_wgrad_compute: bool = option(
        False, "on the last pipeline stage compute the output layer's weight gradients after "
        "the pipeline flush, in a batch, instead of in each microbatch's backward")
    wgrad_deferral_limit: int = option(
        0, "with --defer-embedding-wgrad-compute, microbatches whose weight gradients may wait "
        "(0: all)")
    align_grad_reduce: bool = option(
        True, "", negative=("--no-align-grad-reduce",),
        accepted="either way, with --overlap-grad-reduce each pipeline stage launches a "
        "bucket's gradient reduction as soon as its last backward pass completes the bucket "
        "(upstream's --no-align-grad-reduce); the gradients are the same")
    ddp_bucket_size: Optional[int] = option(
        None, "elements per gradient bucket with --overlap-grad-reduce (default max(40M, "
        "1M x data-parallel size))")
    ddp_average_in_collective: bool = option(
        False, "average gradients in the data-parallel collective itself (ReduceOp.AVG; on "
        "gloo a sum divided by the group size) instead of scaling them by 1/dp first")
    overlap_param_gather: bool = option(False, "overlap the distributed optimizer's parameter "
                                        "all-gather with the next forward pass")
    overlap_param_gather_with_optimizer_step: bool = option(
        False, "", accepted="needs --overlap-param-gather: every parameter all-gather starts as "
        "soon as the optimizer step ends and the next forward waits for it (one optimizer "
        "steps all model chunks here, so they do not overlap the step itself)")
    align_param_gather: bool = option(
        True, "", negative=("--no-align-param-gather",),
        accepted="with --overlap-param-gather and interleaving, the schedule starts a model "
        "chunk's parameter all-gathers, and the next chunk's, before the chunk's first forward; "
        "with --no-align-param-gather, or without interleaving (as upstream), waiting for one "
        "bucket's all-gather starts the next one's")
    scatter_gather_tensors_in_pipeline: bool = option(
        True, "", negative=("--no-scatter-gather-tensors-in-pipeline",),
        accepted="pipeline tensors travel whole (with sequence parallelism they are already "
        "sharded)")
    use_ring_exchange_p2p: bool = unavailable(False, "needs a custom torch build; pipeline p2p "
                                              "uses torch.distributed's isend/irecv")
    local_rank: Optional[int] = option(None, "local rank (default: $LOCAL_RANK, set by torchrun, "
                                       "else 0)", parse=int)
    lazy_mpu_init: Optional[bool] = unavailable(None, "process groups are always created at "
                                                "start-up", parse=bool)
    account_for_embedding_in_pipeline_split: bool = option(
        False, "count the input embedding as one layer when splitting layers over pipeline "
        "stages (the first stage holds one layer fewer)")
    account_for_loss_in_pipeline_split: bool = option(
        False, "count the output layer and loss as one layer when splitting layers over "
        "pipeline stages (the last stage holds one layer fewer)")
    use_distributed_optimizer: bool = option(False, "shard optimizer state over data parallelism")
    num_distributed_optimizer_instances: int = option(
        1, "with --use-distributed-optimizer, shard the optimizer state inside this many "
        "groups of the data-parallel ranks and all-reduce gradients between the groups")
    use_torch_fsdp2: bool = unavailable(False, "FSDP2 is not implemented; shard optimizer "
                                        "state with --use-distributed-optimizer")
    context_parallel_size: int = option(
        1, "context-parallel degree: each sequence split over this many ranks (this tree's "
        "attention, or Transformer Engine's where it is installed)")
    cp_comm_type: list[str] = option(
        ["p2p"], "upstream's key/value exchange under context parallelism, one value or one per "
        "layer; all compute the same attention: a2a trades rows for heads (all-to-all), the "
        "others gather the keys and values here: " + ", ".join(CP_COMM_TYPES), nargs="+")
    hierarchical_context_parallel_sizes: Optional[list[int]] = option(
        None, "with --cp-comm-type a2a+p2p, the context-parallel size as a product (checked; "
        "the attention is the same)", nargs="+")
    nccl_communicator_config_path: Optional[str] = unavailable(
        None, "per-group NCCL communicator settings are not read; use NCCL_* environment "
        "variables")
    use_tp_pp_dp_mapping: bool = option(
        False, "number ranks tp, cp, pp, dp (fastest first) instead of tp, cp, dp, pp")
    replication: bool = unavailable(False, "local checkpoints (nvidia-resiliency-ext) are not "
                                    "implemented")
    replication_jump: Optional[int] = unavailable(None, "local checkpoints are not implemented")
    replication_factor: int = unavailable(2, "local checkpoints are not implemented")
    # This tree's own.
    distributed_startup_timeout_seconds: float = option(
        300.0, "how long start-up waits for every rank to arrive and agree before failing "
               "with the names of the missing or disagreeing ranks")
    variable_seq_lengths: bool = option(
        False, "microbatches of different lengths: one document per sample, no packing; the "
               "pipeline sends each tensor's shape with it")
    variable_seq_length_multiple: Optional[int] = option(
        None, "with --variable-seq-lengths, round each microbatch's length up to a multiple of "
              "this many tokens (default: 8 with --distributed-backend nccl, where each new "
              "length builds its own cuDNN attention plans; 1 otherwise)")
    p2p_timeout_seconds: Optional[float] = option(
        None, "a pipeline p2p operation incomplete this long dumps the flight record and ends "
              "the job (default: --distributed-timeout-minutes)")
    p2p_dump_dir: Optional[str] = option(None, "where hung ranks write their flight records "
                                         "(default: <--save>/p2p_hang or ./p2p_hang)")
    p2p_debug_tags: bool = option(False, "send a tag with every pipeline message and check it "
                                  "on arrival (turns any crossed pairing into an error)")
