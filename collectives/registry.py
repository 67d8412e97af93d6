"""The algorithm registry: one ``Algorithm`` record per algorithm, by collective.

Every algorithm is one ``Algorithm`` record: its name, the collectives it implements, its kind
and what it needs of the communicator. The kind says how a call runs it, in one place
(``collectives.dispatch``):

- ``SCHEDULE``: ``build[collective]`` returns a ``Schedule`` that the executor runs (ring, the
  trees, hierarchical);
- ``DIRECT``: ``launch(call)`` starts the work itself (``shm``, ``hierarchical_shm``);
- ``NATIVE``: the MPI library's own collective (``collectives.native.launch``).

``needs`` is ``ANY``, ``ONE_NODE`` (every rank on one node: a ``ValueError`` on every rank
elsewhere) or ``TOPOLOGY`` (the builder takes the communicator's ``nodes``/``numas``).
``get`` fails loudly on an unknown name, listing the known ones.

*Preferences.* A record with ``agree`` is also a buffer-dependent preference of ``auto`` for
the collectives in ``prefers``: ``agree(call, nbytes)`` returns a *plan* when every rank's
buffers suit it (collective when it may say yes; the same answer on every rank), or None, and
``launch(call, plan)`` receives that plan (None when the algorithm is named). ``op="avg"``
reaches an algorithm as a sum of inputs that the engine divided first
(``collectives.dispatch.mean_first``), unless its record ``averages``: then it divides each
input by the rank count itself before summing (``ops.mean_first``, chunk by chunk while in
cache), and receives the call as the caller made it. ``registered``: it
runs on registered buffers only (``coll.empty``); named with others, it is a ``ValueError`` on
every rank.

This module imports nothing of the package: algorithm modules build their records from it
(``collectives.node.onepass``), ``collectives.select`` registers the built-in ones and picks
among them, and the engine above reads the tables.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Mapping

__all__ = ["Algorithm", "SCHEDULE", "DIRECT", "NATIVE", "ANY", "ONE_NODE", "TOPOLOGY",
           "ANY_COUNTS", "EQUAL", "MATRIX", "COLLECTIVES", "SHM_COLLECTIVES", "REGISTRY",
           "PREFERENCES", "CHANGES", "register", "get", "algorithms"]

COLLECTIVES = ("allreduce", "reduce", "broadcast", "reduce_scatter", "allgather", "alltoall",
               "gather", "scatter", "barrier")
# The collectives the shared-memory window algorithm (``shm``) runs.
SHM_COLLECTIVES = ("allreduce", "reduce", "broadcast", "reduce_scatter", "allgather")
SCHEDULE, DIRECT, NATIVE = "schedule", "direct", "native"
ANY, ONE_NODE, TOPOLOGY = "any", "one node", "topology"
# What an all-to-all algorithm takes: any counts, equal blocks only, or any counts as long as
# every rank's are known (it plans with the whole matrix, so recv_counts cannot stand in).
ANY_COUNTS, EQUAL, MATRIX = "any counts", "equal blocks", "every rank's counts"


@dataclass(frozen=True)
class Algorithm:
    """One algorithm: how to run it (``kind``: ``build`` or ``launch``) and what it needs."""

    name: str
    kind: str
    collectives: tuple[str, ...]
    build: Mapping[str, Callable] = field(default_factory=dict)  # SCHEDULE: collective -> builder
    launch: Callable | None = None  # DIRECT, NATIVE: launch(call), or launch(call, plan)
    needs: str = ANY
    agree: Callable | None = None   # agree(call, nbytes) -> plan or None (see the module doc)
    prefers: tuple[str, ...] = ()   # the collectives whose ``auto`` tries ``agree`` first
    averages: bool = False          # divides each input of ``op="avg"`` first itself
    agree_above: int = 0            # bytes per rank up to which ``agree`` is not asked
    registered: bool = False        # runs on registered buffers only (``coll.empty``)
    counts: str = ANY_COUNTS        # alltoall: the counts it takes (ANY_COUNTS, EQUAL, MATRIX)

    def __post_init__(self):
        if self.kind == SCHEDULE:
            assert set(self.build) == set(self.collectives), self
        else:
            assert self.kind in (DIRECT, NATIVE) and self.launch is not None, self
        assert (self.agree is None) == (not self.prefers), self


# {collective: {name: Algorithm}}: written by ``register`` only; the API reads it on every call.
REGISTRY: dict[str, dict[str, Algorithm]] = {c: {} for c in COLLECTIVES}
# {collective: (Algorithm, ...)}: the records ``auto`` asks to ``agree`` before its table.
PREFERENCES: dict[str, tuple[Algorithm, ...]] = {c: () for c in COLLECTIVES}
# [how many times ``register`` has changed the tables]: a choice made before a change may be
# stale after it. A list of one, so that a reader on every call sees the count without a call.
CHANGES: list = [0]


def register(algorithm: Algorithm) -> None:
    """Make ``algorithm`` available as ``algorithm=its name`` for its collectives (and a
    preference of ``auto`` for those it ``prefers``); a record of the same name replaces
    the earlier one."""
    for collective in COLLECTIVES:
        REGISTRY[collective].pop(algorithm.name, None)
        PREFERENCES[collective] = tuple(a for a in PREFERENCES[collective]
                                        if a.name != algorithm.name)
    for collective in algorithm.collectives:
        REGISTRY[collective][algorithm.name] = algorithm
    for collective in algorithm.prefers:
        PREFERENCES[collective] += (algorithm,)
    CHANGES[0] += 1


def get(collective: str, name: str) -> Algorithm:
    """The algorithm registered as ``name`` for ``collective``."""
    table = REGISTRY.get(collective)
    if table is None:
        raise ValueError(f"unknown collective {collective!r}; expected one of {COLLECTIVES}")
    try:
        return table[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown algorithm {name!r} for {collective}; expected 'auto' or one "
                         f"of {', '.join(sorted(table))}") from None


def algorithms(collective: str) -> tuple[str, ...]:
    """The names ``algorithm=`` accepts for ``collective`` (besides ``"auto"``)."""
    if collective not in REGISTRY:
        raise ValueError(f"unknown collective {collective!r}; expected one of {COLLECTIVES}")
    return tuple(sorted(REGISTRY[collective]))
