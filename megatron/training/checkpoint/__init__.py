"""The parts of checkpointing, one job per file; ``megatron.training.checkpointing`` drives them.

``model_tensors``: layout-free names of this rank's model tensors, and joining / splitting
tensor-parallel shards.
``integrity``: the manifest of every file's size and CRC-32, written at save, checked at load.
``errors``: CheckpointError, the one-line error of a checkpoint that cannot be loaded or written.
"""
