"""A 2-stage pipeline job that fails on purpose (tests/test_pipeline.py): ``raise`` makes stage
1's forward raise; ``mismatch`` makes stage 1 send back a gradient of the wrong shape; ``stall``
makes stage 1 never start its step. Each must end the job, naming the stages (a stall: the
watchdog, naming what stage 0 waits for)."""
import sys
import time

import torch
from torch import nn

import collectives  # noqa: F401 - installs the abort-on-exception hook
from collectives.torch import pipeline as pp

__all__ = []


class Broken(nn.Module):
    def forward(self, x):
        raise RuntimeError("stage one is broken")


def narrowed(backward):
    """``Pipeline._backward`` that then cuts the input's gradient one column short (a stage
    that disagrees with its neighbour: autograd itself never produces one)."""
    def run(self, mb, s, inputs, outputs, grads, in_grads):
        backward(self, mb, s, inputs, outputs, grads, in_grads)
        if (mb, s) in in_grads:
            in_grads[(mb, s)] = in_grads[(mb, s)][:, :5]
    return run


def main(mode):
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    r = comm.Get_rank()
    torch.manual_seed(0)
    first = nn.Linear(6, 6)
    second = Broken() if mode == "raise" else nn.Linear(6, 6)
    if mode == "mismatch" and r == 1:
        pp.Pipeline._backward = narrowed(pp.Pipeline._backward)
    sched = pp.schedule("1f1b", 2, 2)
    runner = pp.Pipeline(first if r == 0 else second, comm=comm, schedule=sched,
                         loss_fn=nn.functional.mse_loss)
    x, y = torch.randn(4, 6), torch.randn(4, 6)
    if mode == "stall" and r == 1:
        time.sleep(120)  # ended by the watchdog of rank 0, which waits for a gradient
    runner.step(x, y)


if __name__ == "__main__":
    main(sys.argv[1])
