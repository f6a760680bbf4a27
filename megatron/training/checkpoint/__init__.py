"""The parts of checkpointing, one job per file; ``megatron.training.checkpointing`` drives them.

``model_tensors``: layout-free names of this rank's model tensors, and joining / splitting
tensor-parallel shards.
``integrity``: the manifest of every file's size and CRC-32, written at save, checked at load.
Saving: ``save_job`` writes a checkpoint's tensors and publishes it, now or in the background
(``pending``: the one being written, --async-save). Loading: ``parallel_load`` reads each
tensor once per data-parallel group (--ckpt-fully-parallel-load).
Interoperation with upstream (issue 15): ``formats`` detects a directory's format and opens its
reader (``source``): ``layout_free`` (this tree), ``upstream_torch`` (legacy per-rank files),
``upstream_dist`` (torch_dist), with the names of ``megatron.core.dist_checkpointing.upstream_names``;
``model_loading`` fills a model, and ``optimizer_state`` the optimizer, from any reader;
``upstream_resume`` is ``--load``'s path for upstream formats; ``dist_save`` is
``--ckpt-format torch_dist`` (``sharded_objects``: megatron-core's sharded objects, there the
RNG and rerun states; ``rng_state``: upstream's per-rank RNG layout, saved and restored;
``dist_optimizer_common``: the optimizer's part of ``common.pt``);
``tp_layout``, ``model_shape`` and ``hf_export`` serve the converter.

What megatron-core's sharded-checkpoint API shares with these parts lives in
``megatron.core.dist_checkpointing``: ``errors`` (CheckpointError, the one-line error of a
checkpoint that cannot be loaded or written), ``safe_load`` (every read of a pickle), ``ranks``,
and in ``strategies`` ``dcp_save`` (a torch.distributed.checkpoint save cut into plan / write /
finish) and ``dcp_chunks`` (pieces of layer-stacked tensors).
"""
