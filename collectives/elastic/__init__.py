"""Training that survives a dead rank.

    from collectives import elastic
    state = elastic.State(model=model, optimizer=opt, step=0)
    @elastic.run(state, comm=MPI.COMM_WORLD, min_ranks=2)
    def train(state, comm):          # comm: the current (possibly shrunk) communicator
        for state.step in range(state.step, steps):
            ...; state.commit()
    train()

Parts: ``state`` (what is kept, committed in memory), ``detect`` (which path the MPI library
supports; which errors mean a failed process), ``recover`` (revoke, shrink, forget the caches),
``loop`` (``run``: recover and call again), ``data`` (the global batch split over the ranks
left), ``mesh`` (a dp x tp mesh that drops the dead rank's tp group), ``replace`` (replacement
ranks: spawn, merge, the state from a live peer), ``inject`` (kill a rank at a step),
``checkpoint`` (asynchronous sharded checkpoints) and ``supervisor`` (``python -m
collectives.elastic run``: restart where the library has no fault tolerance). docs/elastic.md
says what is guaranteed and how to launch.
"""
from __future__ import annotations

from .data import GlobalBatches
from .detect import fault_tolerant, process_failure
from .inject import FailureInjector
from .loop import RanksLost, Recovery, run
from .mesh import ElasticMesh
from .state import Commit, State

__all__ = ["State", "Commit", "run", "Recovery", "RanksLost", "fault_tolerant",
           "process_failure", "FailureInjector", "GlobalBatches", "ElasticMesh"]
