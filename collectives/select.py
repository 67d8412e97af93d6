"""The built-in algorithms, and what ``algorithm="auto"`` picks.

*The built-in algorithms.* The records of ring, the trees, hierarchical, ``native``, ``shm``,
``hierarchical_shm`` and ``onepass`` are registered in ``collectives.registry`` when this
module is imported; the record type, the tables and ``get``/``algorithms`` live there and
are re-exported here.

*The tuning table.* ``auto`` is a lookup, never a measurement inside a user's call: for each
collective, rules ``[max_bytes, algorithm]`` per communicator size, tried in order; the first
rule whose ``max_bytes`` (null: no limit) is at least the message size wins. The table is
``DEFAULT_TABLE`` below, measured on this project's CI machine kind (2 cores, MPICH from the
package index, one node, 2 and 3 ranks: docs/performance.md has the figures and the command),
unless a JSON file of the same shape is named by ``COLLECTIVES_TUNING`` (or found at
``~/.cache/collectives/tuning.json``; ``python -m bench tune`` writes one)::

    {"version": 1, "signature": "...", "tables": {
        "allreduce": {"2": [[4096, "native"], [null, "ring"]], "default": [[null, "ring"]],
                      "in-place": {"2": [[1048576, "native"], [null, "ring"]]}},
        ...}}

A communicator size without rules of its own uses the nearest smaller size that has them, then
``"default"``. An allreduce in place (``out=x`` on every rank, as ``MPI_IN_PLACE``) uses the
``"in-place"`` rules where there are some for its size: in place, the buffer a rank sends is the
one it has just written, and reading freshly written memory from another process costs more, so
the crossovers move. A single-node algorithm picked for a communicator that spans nodes becomes
its hierarchical counterpart (``MULTI_NODE``), and where every node holds one rank (a network
between all ranks), the part of that across nodes (``ONE_RANK_A_NODE``). Where the ranks span
nodes of several ranks each, a collective's ``"multi-node"`` rules apply where it has some (for
out-of-place and in-place calls alike), measured on hosts joined by a network. Sizes are the per-rank
input's bytes (for allgather, whose ranks may differ in length, the mean).
"""
from __future__ import annotations

import json
import os
from pathlib import Path

from . import config, hierarchical, hierarchical_alltoall, native, ring, tree
from .node import composite, onepass, shm
from .registry import (ANY, ANY_COUNTS, COLLECTIVES, DIRECT, EQUAL, MATRIX, NATIVE, ONE_NODE,
                       PREFERENCES, REGISTRY, SCHEDULE, SHM_COLLECTIVES, TOPOLOGY, Algorithm,
                       algorithms, get, register)

__all__ = ["Algorithm", "SCHEDULE", "DIRECT", "NATIVE", "ANY", "ONE_NODE", "TOPOLOGY",
           "ANY_COUNTS", "EQUAL", "MATRIX", "COLLECTIVES", "SHM_COLLECTIVES", "REGISTRY",
           "PREFERENCES", "register", "get", "algorithms", "auto", "rule", "load_table",
           "DEFAULT_TABLE", "IN_PLACE_RULES", "MULTI", "MULTI_NODE", "ONE_RANK_A_NODE", "tuning_path",
           "describe"]


def _register_builtin() -> None:
    for name, build, needs, counts in (
        ("ring", {"allreduce": ring.allreduce, "reduce_scatter": ring.reduce_scatter,
                  "allgather": ring.allgather, "broadcast": ring.broadcast}, ANY, ANY_COUNTS),
        ("tree", {"allreduce": tree.allreduce, "reduce": tree.reduce,
                  "broadcast": tree.broadcast}, ANY, ANY_COUNTS),
        ("binomial", {"allreduce": tree.binomial_allreduce, "reduce": tree.binomial_reduce,
                      "broadcast": tree.binomial_broadcast, "gather": tree.binomial_gather,
                      "scatter": tree.binomial_scatter}, ANY, ANY_COUNTS),
        ("pairwise", {"alltoall": ring.pairwise_alltoall}, ANY, ANY_COUNTS),
        ("bruck", {"alltoall": tree.bruck_alltoall}, ANY, EQUAL),
        ("double_binary_tree", {"allreduce": tree.double_binary_tree_allreduce}, ANY,
         ANY_COUNTS),
        ("recursive_doubling", {"allreduce": tree.recursive_doubling_allreduce,
                                "allgather": tree.recursive_doubling_allgather}, ANY,
         ANY_COUNTS),
        ("rabenseifner", {"allreduce": tree.rabenseifner_allreduce}, ANY, ANY_COUNTS),
        ("recursive_halving", {"reduce_scatter": tree.recursive_halving_reduce_scatter}, ANY,
         ANY_COUNTS),
        ("hierarchical", {"allreduce": hierarchical.allreduce,
                          "reduce_scatter": hierarchical.reduce_scatter,
                          "allgather": hierarchical.allgather, "reduce": hierarchical.reduce,
                          "broadcast": hierarchical.broadcast,
                          "alltoall": hierarchical_alltoall.hierarchical_alltoall}, TOPOLOGY,
         MATRIX),
    ):
        register(Algorithm(name, SCHEDULE, tuple(build), build=build, needs=needs,
                           counts=counts))
    register(Algorithm("native", NATIVE, COLLECTIVES, launch=native.launch))
    register(Algorithm("shm", DIRECT, SHM_COLLECTIVES, launch=shm.launch, needs=ONE_NODE))
    register(Algorithm("hierarchical_shm", DIRECT, ("allreduce",),
                       launch=composite.launch_shm))
    register(onepass.ALGORITHM)


_register_builtin()


# The key of a collective's rules for communicators that span nodes of several ranks (per
# communicator size, as the other rules). The built-in ones were measured on 2 hosts x 2 ranks
# joined by 1 and 10 Gbit/s links (``python -m bench cluster``; docs/topology.md): MPI's own
# for small messages, then the hierarchical composite, which sends each byte across a host's
# link once each way.
MULTI = "multi-node"

# Measured on the CI machine kind (2 cores, MPICH from the package index, one node) at 2 and 3
# ranks with `python -m bench tune` and the benchmarks; each rule is the algorithm that was the
# fastest, or within the noise of the fastest, at that size in every run (docs/performance.md).
# Rank counts above 3 oversubscribe this machine; they use the 3-rank rules. "shm" stands for a
# single-node communicator: `auto` swaps it for a hierarchical composite on several nodes.
DEFAULT_TABLE = {
    "allreduce": {
        MULTI: {"default": [[16 << 10, NATIVE], [None, "hierarchical"]]},
        "2": [[16 << 10, NATIVE], [8 << 20, "recursive_doubling"], [None, "ring"]],
        "3": [[32 << 10, NATIVE], [2 << 20, "shm"], [None, "ring"]],
        "in-place": {
            "2": [[128 << 10, NATIVE], [2 << 20, "shm"], [None, "ring"]],
            "3": [[64 << 10, NATIVE], [2 << 20, "shm"], [8 << 20, "ring"],
                  [None, "hierarchical"]],
        },
    },
    "reduce_scatter": {
        MULTI: {"default": [[4 << 10, NATIVE], [None, "hierarchical"]]},
        "2": [[128 << 10, NATIVE], [512 << 10, "recursive_halving"], [None, "ring"]],
        "3": [[64 << 10, NATIVE], [2 << 20, "shm"], [None, "ring"]],
    },
    "allgather": {
        MULTI: {"default": [[8 << 10, NATIVE], [None, "hierarchical"]]},
        "2": [[128 << 10, NATIVE], [4 << 20, "ring"], [None, NATIVE]],
        "3": [[None, NATIVE]],
    },
    "broadcast": {
        "2": [[8 << 20, NATIVE], [None, "shm"]],
        "3": [[4 << 20, NATIVE], [8 << 20, "binomial"], [None, "shm"]],
    },
    "reduce": {
        "2": [[32 << 10, NATIVE], [None, "shm"]],
        "3": [[16 << 10, NATIVE], [None, "shm"]],
    },
    "alltoall": {"2": [[None, NATIVE]], "3": [[None, NATIVE]]},
    "gather": {"2": [[None, NATIVE]], "3": [[None, NATIVE]]},
    "scatter": {"2": [[None, NATIVE]], "3": [[None, NATIVE]]},
    "barrier": {"2": [[None, NATIVE]], "3": [[None, NATIVE]]},
}
for _rules in DEFAULT_TABLE.values():
    _rules.setdefault("default", _rules[min((k for k in _rules if k.isdigit()), key=int)])

# What a single-node algorithm becomes when the communicator spans several nodes, and what
# that becomes when every node holds one rank (no node stage to do: the part across nodes).
MULTI_NODE = {"shm": {"allreduce": "hierarchical_shm", "default": "hierarchical"}}
ONE_RANK_A_NODE = {"hierarchical_shm": "ring", "hierarchical": NATIVE}

# The collectives whose ``"in-place"`` rules are used: those in place on every rank or on none
# (as MPI_IN_PLACE), so that every rank picks alike. Not ``reduce``: only its root can be.
IN_PLACE_RULES = ("allreduce",)


def tuning_path() -> Path | None:
    """The tuning file ``auto`` reads, if any: ``COLLECTIVES_TUNING``, else the default path
    where a file exists there."""
    named = config.get("COLLECTIVES_TUNING")
    if named is not None:
        return Path(named)
    default = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / \
        "collectives" / "tuning.json"
    return default if default.exists() else None


_TABLE: list = []  # [(COLLECTIVES_TUNING, table)]: the table in force, read once


def load_table() -> dict:
    """The tuning table in force: the file's rules over ``DEFAULT_TABLE``. Read once per
    process and setting (``config.reload`` or ``config.set`` makes it read again); a named
    file that is missing or does not parse is a ``ValueError`` naming the setting."""
    setting = config.get("COLLECTIVES_TUNING")
    if _TABLE and _TABLE[0][0] == setting:
        return _TABLE[0][1]
    path = tuning_path()
    table = {c: {k: dict(v) if isinstance(v, dict) else v for k, v in rules.items()}
             for c, rules in DEFAULT_TABLE.items()}
    if path is not None:
        try:
            tables = json.loads(path.read_text())["tables"]
            for collective, rules in tables.items():
                mine = table.setdefault(collective, {})
                for key, value in rules.items():  # per communicator size, in place as well
                    if isinstance(value, dict):
                        mine.setdefault(key, {}).update(value)
                    else:
                        mine[key] = value
                _check_rules(collective, rules)
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"COLLECTIVES_TUNING={str(path)!r}: not a readable tuning table "
                             f"({type(exc).__name__}: {exc}); `python -m bench tune` writes "
                             f"one") from None
    _TABLE[:] = [(setting, table)]
    return table


def _check_rules(collective: str, rules: dict) -> None:
    if collective not in REGISTRY:
        raise ValueError(f"unknown collective {collective!r}")
    for key, value in rules.items():
        for rule in (value.values() if isinstance(value, dict) else [value]):
            for limit, name in rule:
                if limit is not None and not isinstance(limit, int):
                    raise ValueError(f"{collective} {key}: limit {limit!r} is not a byte count")
                if get(collective, name).registered:
                    raise ValueError(f"{collective} {key}: {name!r} runs on registered buffers "
                                     f"only, which auto takes on its own where every rank's "
                                     f"are; a table cannot name it")


def _for_size(rules_by_size: dict, size: int):
    """The rules of ``size`` ranks: its own, the nearest smaller size's, or ``"default"``."""
    rules = rules_by_size.get(str(size))
    if rules is None:
        smaller = [int(k) for k in rules_by_size if k.isdigit() and int(k) < size]
        rules = rules_by_size[str(max(smaller))] if smaller else rules_by_size.get("default")
    return rules


def rule(table: dict, collective: str, nbytes: int, size: int, inplace: bool = False,
         multi_node: bool = False) -> str:
    """The algorithm ``table`` (``DEFAULT_TABLE``'s shape) names for ``nbytes`` per rank on
    ``size`` ranks (``inplace``: a call with ``out=x``; ``multi_node``: ranks on several nodes,
    whose ``"multi-node"`` rules apply where there are some), before ``MULTI_NODE``. Past the
    last rule's ``max_bytes`` (a tuning file's rules end at the largest size ``bench tune``
    measured), ``DEFAULT_TABLE``'s rules apply."""
    rules_by_size = table.get(collective, {})
    rules = None
    if multi_node:
        rules = _for_size(rules_by_size.get(MULTI) or {}, size)
    if rules is None and inplace and collective in IN_PLACE_RULES:
        rules = _for_size(rules_by_size.get("in-place") or {}, size)
    if rules is None:
        rules = _for_size(rules_by_size, size)
    for limit, name in rules or ():
        if limit is None or nbytes <= limit:
            return name
    # A tuning file governs only the sizes it measured.
    if table is not DEFAULT_TABLE:
        return rule(DEFAULT_TABLE, collective, nbytes, size, inplace, multi_node)
    return NATIVE


def auto(collective: str, nbytes: int, size: int, single_node=True, inplace=False,
         alone=False) -> str:
    """The algorithm ``auto`` runs for ``nbytes`` per rank on ``size`` ranks (``inplace``: a
    call with ``out=x``). ``single_node`` (all ranks on one node) and ``alone`` (one rank on
    every node): bools, or callables asked only when it matters (where the collective has
    multi-node rules, or the rule names a single-node algorithm). The multi-node rules are for
    nodes of several ranks; where every node holds one rank, the ranks are a flat network and
    the other rules apply."""
    def ask(flag):
        return flag() if callable(flag) else flag

    table = load_table()
    spans = None  # whether the ranks span nodes, once asked
    several = False
    if size > 1 and table.get(collective, {}).get(MULTI):
        spans = not ask(single_node)
        several = spans and not ask(alone)
    name = rule(table, collective, nbytes, size, inplace, several)
    swap = MULTI_NODE.get(name)
    if swap is not None and (spans if spans is not None else not ask(single_node)):
        name = swap.get(collective, swap["default"])
        if ask(alone):
            name = ONE_RANK_A_NODE.get(name, name)
    return name if name in REGISTRY[collective] else NATIVE


def _bytes(n: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return f"{n / (1 << shift):.4g} {unit}"
    return f"{n} B"


def describe(rules) -> str:
    """A rule list in words: ``[[32768, "native"], [None, "ring"]]`` -> ``native ≤ 32 KiB,
    ring``."""
    return ", ".join(name.replace("_", " ") if limit is None else
                     f"{name.replace('_', ' ')} ≤ {_bytes(limit)}" for limit, name in rules)
