"""Two ranks that each wait for a message the other never sends (tests/test_p2p.py): p2p's
watched wait must end the job at ``COLLECTIVES_TIMEOUT``, naming what each rank waits for.
``stall``: the same, the wait ended by a stall warning and then the timeout."""
import numpy as np

import collectives  # noqa: F401 - installs the abort-on-exception hook
from collectives import p2p

__all__ = []


def main():
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    r = comm.Get_rank()
    peer = (r + 1) % comm.Get_size()
    out = np.empty(4, np.float32)
    p2p.recv(comm, out, peer, 7 + r, what=f"p2p fault test: rank {r}'s receive")


if __name__ == "__main__":
    main()
