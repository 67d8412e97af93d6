"""collectives.torch: torch tensors, drop-in collectives, DistributedDataParallel, comm hooks.

    from collectives.torch import DistributedDataParallel, all_reduce
    model = DistributedDataParallel(module)            # mpiexec -n N python train.py
    all_reduce(t)                                      # in place, like torch.distributed

``collectives.torch.hooks`` holds the comm hooks (allreduce, fp16/bf16 compression, PowerSGD);
``collectives.torch.backend`` registers ``"collectives"`` as a ``torch.distributed`` backend.
Importing this package imports torch (the core toolkit never does).
"""
from .buckets import GradBucket
from .ddp import CommStats, DistributedDataParallel
from .memory import empty, zeros
from .sharded import ShardedDataParallel
from . import pipeline, tensor_parallel
from .functional import (
    Work,
    all_gather_into_tensor,
    all_reduce,
    all_to_all,
    all_to_all_single,
    broadcast,
    gather,
    reduce_scatter_tensor,
    scatter,
    wait_future,
)
from .hooks import (
    DefaultState,
    PowerSGDState,
    allreduce_hook,
    bf16_compress_hook,
    bf16_compress_wrapper,
    fp16_compress_hook,
    fp16_compress_wrapper,
    powerSGD_hook,
)

__all__ = [
    "DistributedDataParallel", "CommStats", "pipeline", "GradBucket", "ShardedDataParallel",
    "all_reduce", "broadcast", "all_gather_into_tensor", "reduce_scatter_tensor", "Work",
    "all_to_all_single", "all_to_all", "gather", "scatter",
    "wait_future", "empty", "zeros", "tensor_parallel",
    "DefaultState", "PowerSGDState", "allreduce_hook", "fp16_compress_hook",
    "bf16_compress_hook", "fp16_compress_wrapper", "bf16_compress_wrapper", "powerSGD_hook",
]
