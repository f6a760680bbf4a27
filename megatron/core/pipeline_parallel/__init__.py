"""Pipeline parallelism: the p2p ordering rule, schedules as data, p2p communication."""

from megatron.core.pipeline_parallel.schedules import get_forward_backward_func

__all__ = ["get_forward_backward_func"]
