"""The parts of checkpointing, one job per file; ``megatron.training.checkpointing`` drives them.

``model_tensors``: layout-free names of this rank's model tensors, and joining / splitting
tensor-parallel shards.
``integrity``: the manifest of every file's size and CRC-32, written at save, checked at load.
``errors``: CheckpointError, the one-line error of a checkpoint that cannot be loaded or written.
Saving: ``dcp_save`` cuts a torch.distributed.checkpoint save into plan / write / finish;
``save_job`` writes a checkpoint's tensors and publishes it, now or in the background
(``pending``: the one being written, --async-save). Loading: ``parallel_load`` reads each
tensor once per data-parallel group (--ckpt-fully-parallel-load).
Interoperation with upstream (issue 15): ``formats`` detects a directory's format and opens its
reader (``source``): ``layout_free`` (this tree), ``upstream_torch`` (legacy per-rank files),
``upstream_dist`` (torch_dist); ``upstream_names`` maps local/TE names and tensor-parallel cuts;
``model_loading`` fills a model, and ``optimizer_state`` the optimizer, from any reader;
``upstream_resume`` is ``--load``'s path for upstream formats; ``dist_save`` is
``--ckpt-format torch_dist`` (``sharded_objects``: megatron-core's sharded objects, there the
RNG and rerun states; ``rng_state``: upstream's per-rank RNG layout, saved and restored;
``dist_optimizer_common``: the optimizer's part of ``common.pt``); ``dcp_chunks`` stores pieces
of layer-stacked tensors;
``tp_layout``, ``model_shape`` and ``hf_export`` serve the converter.

``errors``, ``safe_load``, ``ranks``, ``dcp_chunks`` and ``dcp_save`` live in
``megatron.core.dist_checkpointing`` (megatron-core's sharded-checkpoint API, issue 26, saves and
loads through them); the modules of those names here import them from there.
"""
