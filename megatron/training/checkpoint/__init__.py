"""The parts of checkpointing, one job per file; ``megatron.training.checkpointing`` drives them.

``model_tensors``: layout-free names of this rank's model tensors, and joining / splitting
tensor-parallel shards.
"""
