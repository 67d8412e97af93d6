"""Which algorithms exist for each collective, and what ``algorithm="auto"`` picks.

The registry maps ``(collective, name)`` to a schedule builder, or to ``NATIVE`` (the MPI
library's own collective). ``get`` fails loudly on an unknown name, listing the known ones.

``auto`` reads a *tuning table*: for each collective, rules ``[max_bytes, algorithm]`` per
communicator size, tried in order; the first rule whose ``max_bytes`` (null: no limit) is at
least the message size wins. The table is ``DEFAULT_TABLE`` below, measured on this project's
CI machine kind (2 cores, MPICH from the package index, n = 2 and 3), unless a JSON file of the
same shape is named by ``COLLECTIVES_TUNING`` (or found at ``~/.cache/collectives/tuning.json``;
``python -m bench tune`` writes one). Schema::

    {"version": 1, "signature": "...", "tables": {
        "allreduce": {"2": [[4096, "native"], [null, "ring"]], "default": [[null, "ring"]],
                      "in-place": {"2": [[1048576, "native"], [null, "ring"]]}},
        ...}}

A communicator size without rules of its own uses the nearest smaller size that has them, then
``"default"``. An allreduce in place (``out=x``, which must then be in place on every rank,
as with MPI_IN_PLACE) uses the ``"in-place"`` rules where the table has them for its
communicator size (found the same way), else the others: in place, the buffer a rank sends
is the one it has just written, and reading freshly written memory from another process costs
more (measured at n = 2: a 512 KiB exchange of just-written data took 4x as long as one of
untouched data under MPICH's CMA transfers), so the crossovers move. A single-node algorithm
(``shm``) picked for a communicator that spans nodes is replaced by its hierarchical
counterpart (``MULTI_NODE``). Sizes are message bytes (count x
itemsize) of the per-rank input (for allgather, whose ranks may differ in length, the mean).

A rule may name more than one algorithm, ``[max_bytes, first, other, ...]``: algorithms that
were within the noise of each other, or that ran in two modes from one process launch to the
next (measured: binomial reduce at 128 KiB, n = 2, ran 38-46 us in some launches and 58-65 us
in others, native 43-52 in all). ``auto`` then measures them at run time where that cannot
change a result (``collectives.api._Trial``: blocks of each in turn; every rank takes the
fastest by the slowest rank's time); elsewhere, and with ``COLLECTIVES_AUTO_TRIAL=0``, it runs
the first.
``candidates`` lists them, ``auto`` returns the first.
"""
from __future__ import annotations

import importlib
import importlib.util
import json
import os
from pathlib import Path

from .errors import getenv

__all__ = ["NATIVE", "REGISTRY", "register", "get", "algorithms", "auto", "candidates",
           "load_table", "DEFAULT_TABLE", "COLLECTIVES", "tuning_path", "MOVES", "bits",
           "races", "runs", "distinct", "describe"]

COLLECTIVES = ("allreduce", "reduce", "broadcast", "reduce_scatter", "allgather")
NATIVE = "native"

# {collective: {name: builder}}: written by ``register`` only. The API reads it directly on
# every call (a miss, e.g. before the built-in algorithms are loaded, goes through ``get``).
REGISTRY: dict[str, dict[str, object]] = {c: {NATIVE: NATIVE} for c in COLLECTIVES}
_LOADED = False


def register(collective: str, name: str, builder) -> None:
    """Make ``builder`` available as ``algorithm=name`` for ``collective``."""
    REGISTRY[collective][name] = builder


def _load_builtin() -> None:
    """Register the algorithms that ship with the toolkit (imported on first use)."""
    global _LOADED
    if _LOADED:
        return
    _LOADED = True
    from collectives import ring, tree
    register("allreduce", "ring", ring.allreduce)
    register("reduce_scatter", "ring", ring.reduce_scatter)
    register("allgather", "ring", ring.allgather)
    register("broadcast", "ring", ring.broadcast)
    for collective, name, attr in (
        ("allreduce", "tree", "allreduce"),
        ("allreduce", "binomial", "binomial_allreduce"),
        ("allreduce", "double_binary_tree", "double_binary_tree_allreduce"),
        ("allreduce", "recursive_doubling", "recursive_doubling_allreduce"),
        ("allreduce", "rabenseifner", "rabenseifner_allreduce"),
        ("reduce", "tree", "reduce"),
        ("reduce", "binomial", "binomial_reduce"),
        ("broadcast", "tree", "broadcast"),
        ("broadcast", "binomial", "binomial_broadcast"),
        ("reduce_scatter", "recursive_halving", "recursive_halving_reduce_scatter"),
        ("allgather", "recursive_doubling", "recursive_doubling_allgather"),
    ):
        builder = getattr(tree, attr, None)
        if builder is not None:
            register(collective, name, builder)
    for module in ("collectives.hierarchical", "collectives.shm"):
        if importlib.util.find_spec(module) is not None:
            importlib.import_module(module)  # each registers its own algorithms on import


def get(collective: str, name: str):
    """The builder registered as ``name`` for ``collective`` (``NATIVE`` for the library's)."""
    _load_builtin()
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
    _load_builtin()
    if collective not in REGISTRY:
        raise ValueError(f"unknown collective {collective!r}; expected one of {COLLECTIVES}")
    return tuple(sorted(REGISTRY[collective]))


# Measured on the CI machine kind (2 cores, MPICH 5.0.2 from the package index, one node) with
# `mpiexec -n {2,3} python -m bench tune` and the benchmark (2026-11-30, with the race of the
# close contenders), then smoothed by hand where two algorithms were within the noise of each
# other or two runs disagreed: the rule kept is the algorithm near the top in every run. Sizes
# are per-rank input bytes. "shm" rules stand for single-node communicators; `auto` swaps them
# for the hierarchical composites on several nodes (MULTI_NODE below). Rank counts above 3
# oversubscribe this machine; they use the 3-rank rules. Revised (2026-11-30, later) from seven
# full runs (tune, then every benchmark at n = 2 and 3): where the rule's first was below 0.9 of
# the row's best in some run and another stayed within 0.9-0.96 in all (3 ranks: allgather at
# 683 KiB per rank, shm 0.82 against ring 0.90 and 1.00 in the median run; 11 MiB shm 0.82 against
# ring 0.96; reduce_scatter at 683 KiB shm 0.89 against ring 0.95; allreduce at 2 MiB ring 0.80
# against shm 0.89 out of place, 1.00 in place; broadcast at 8 MiB native 0.55 against binomial
# 0.95; 2 ranks: allgather at 16 MiB shm 0.74 against recursive doubling 0.93; reduce at 8 MiB
# binomial 0.82 against tree 0.86 and 1.00 in place).
DEFAULT_TABLE = {
    # A rule's further names are its alternates (see the module doc): the algorithms that
    # traded places with the first from one benchmark run to the next (four runs, 2026-11-30;
    # the n = 2 reductions from 128 KiB measured again after the executor's speed-up).
    # They are measured at run time only where the choice cannot change a result (2 ranks,
    # data movement, or among algorithms of one order, ``bits``), so the 3-rank reductions name
    # no other.
    "allreduce": {
        # Since the executor's per-message Python was cut (~30% of a small schedule call),
        # recursive doubling passes MPICH's own at 128 KiB (0.84x its time; two tunes agreed).
        # Above 512 KiB, to 2 MiB, recursive doubling (one exchange of the whole vector) and
        # ring (two of halves) trade places by 25-35% (2026-12-03, at 2 MiB: recursive doubling
        # the best in a tune, a benchmark and `make demo`, ring 0.65-0.79 of it; ring the best
        # in a tune and two benchmarks, recursive doubling down to 0.86 of it): both race.
        # Ten full runs later (D0-G1, 2026-12-03, docs/bench.md "A twenty-fifth session"):
        # recursive doubling the best at 2 MiB in all ten (0.97 at worst), ring 0.75 of it
        # in the median run: recursive doubling leads there, ring races it.
        "2": [[32 << 10, NATIVE], [128 << 10, "recursive_doubling", NATIVE],
              [2 << 20, "recursive_doubling", "ring", "double_binary_tree"],
              [None, "ring", "double_binary_tree", "rabenseifner"]],
        # Until D0-G1 (below), n = 3 out of place: tree or shm (raced) to 512 KiB, ring above. Six
        # runs (2026-12-01, "A sixteenth session" in docs/bench.md; cells: the worst of the six,
        # best / algorithm): 128 KiB tree 0.94 (native 0.89), 512 KiB tree 0.99, 2 MiB ring 0.995
        # where shm, this rule's first there before, ran at 0.80-0.93 and missed in two runs, 8 MiB
        # ring 1.00, 32 MiB ring 0.98 (hierarchical 0.99).
        # Above 512 KiB shm combines as ring does (``bits``), and so does hierarchical on one
        # node, so the three race: they traded places from launch to launch (runs F6-G0,
        # 2026-12-02, docs/bench.md: at 8 MiB ring, the pick, ran at 0.85-0.93 of shm in three
        # runs; at 32 MiB in place shm, the tune's pick, at 0.76 of ring in one).
        # D0-G1: shm the best of the row at 128 KiB - 2 MiB in every one of the ten runs
        # (tree 0.68-0.85 of it in the median run, ring 0.75 at 2 MiB): shm leads there.
        "3": [[32 << 10, NATIVE], [512 << 10, "shm", "tree"],
              [2 << 20, "shm", "ring", "hierarchical"], [None, "ring", "shm", "hierarchical"]],
        # Until D0-G1 (below): in place at n = 2, MPICH's own ahead to 512 KiB (recursive doubling,
        # which wins there out of place, took 2.2x native's time in place). At n = 3, the same six
        # runs: native the best at 128 KiB in all six (shm, the rule's first before, 0.80); ring at
        # 512 KiB (the best in four, 0.92 at worst; shm 0.88, tree 0.87, double binary tree 0.79:
        # the tunes picked those, and four runs missed there), 2 MiB (0.93; the others 0.85 and
        # below) and 8 MiB (0.99); hierarchical at 32 MiB (0.99; ring 0.96, shm, the rule's first
        # before, 0.90).
        # D0-G1 (ten runs): in place at n = 2, shm the best at 512 KiB (native 0.88 of it in
        # the median run; they trade places) and 2 MiB (ring 0.74); at n = 3, shm the best at
        # 128 KiB, 512 KiB and 2 MiB in every run (native 0.90, ring 0.67-0.68).
        "in-place": {
            "2": [[128 << 10, NATIVE], [512 << 10, "shm", NATIVE],
                  [2 << 20, "shm", "ring", "double_binary_tree"],
                  [None, "ring", "double_binary_tree", "rabenseifner"]],
            "3": [[64 << 10, NATIVE], [512 << 10, "shm", "tree"],
                  [2 << 20, "shm", "ring", "hierarchical"],
                  [8 << 20, "ring", "shm", "hierarchical"],
                  [None, "hierarchical", "ring", "shm"]],
        },
    },
    "reduce_scatter": {
        # shm at 2 ranks from 512 KiB: in two of three full runs (2026-11-30, late) the best
        # of the row at one or two sizes, 1.07-1.12x faster than what the tune just before
        # had put first there.
        "2": [[128 << 10, NATIVE], [512 << 10, "recursive_halving", "ring", "shm"],
              [None, "ring", "recursive_halving", "shm"]],
        # At 3 ranks ring, shm and hierarchical combine alike (select.bits) and race. D0-G1
        # (ten runs): shm the best at 128 KiB - 2 MiB in every run (native 0.82 at 128 KiB,
        # ring 0.68-0.87), native at 32 KiB, ring at 8 and 32 MiB.
        "3": [[64 << 10, NATIVE], [2 << 20, "shm", "ring", "hierarchical"],
              [None, "ring", "shm", "hierarchical"]],
    },
    "allgather": {
        # MPI's own is MPI_Allgather for equal lengths (native.allgather; it was Allgatherv,
        # 1.3-2x slower): it led every size to 4 MiB per rank by 10-40% at n = 2 and 3 (two
        # tunes and a benchmark, 2026-11-30); above, it, shm and the schedules were within 10%.
        # Ten runs later (D0-G1, 2026-12-03), ring the best from 256 KiB to 4 MiB per rank
        # (native 0.62-0.92 of it in the median run): ring leads there, native races it.
        "2": [[128 << 10, NATIVE], [4 << 20, "ring", NATIVE, "shm"],
              [None, NATIVE, "shm", "recursive_doubling"]],
        # 3 ranks, 512 KiB - 2 MiB: shm the best by 1.3-1.4x in some launches, 0.73-0.85 of
        # native in others (2026-11-30, late): the trial decides at run time.
        "3": [[32 << 10, NATIVE], [4 << 20, NATIVE, "shm"], [None, NATIVE, "shm", "ring"]],
    },
    "broadcast": {
        # shm runs in two modes minutes apart here (2 ranks, 2 MiB: 0.52-0.6x native's time
        # in two benchmark runs, 3.5x in the tunes just before; 8 MiB: 0.55-0.8 ms or 2-3 ms,
        # native 0.7-1.1 ms): from 512 KiB the trial measures both at run time.
        "2": [[256 << 10, NATIVE], [8 << 20, NATIVE, "shm"], [None, "shm", NATIVE]],
        # 3 ranks: shm 1.15-1.4x faster than the rule's first at 2 and 8 MiB in four of six
        # full runs (2026-11-30, late), slower in the tunes before them.
        "3": [[256 << 10, NATIVE], [4 << 20, NATIVE, "shm"], [8 << 20, "binomial", NATIVE, "shm"],
              [None, "shm", "binomial", NATIVE]],
    },
    "reduce": {
        # 128 KiB at n = 2: binomial and tree ran 38-46 us in some process launches and 58-65
        # in others, native 43-52 in all, until the executor's per-message Python was cut:
        # now 0.74-0.81x native's time (two tunes and a benchmark agreed); of six full runs
        # binomial was the best there in all, tree 0.78-1.00 of it.
        # Then shm's reduce (the others copy into the window and go on; the root reduces) from
        # 128 KiB (2026-11-30, one launch each): n = 2 1.1x the best message-based algorithm
        # at 128 KiB, 1.45-2x from 512 KiB; n = 3 1.1x at 128 KiB, 1.4-2.2x from 512 KiB.
        "2": [[32 << 10, NATIVE], [128 << 10, "shm", "binomial", "tree"],
              [None, "shm", "tree", "binomial"]],
        # At 3 ranks shm runs in two modes, minutes apart: 1.3-1.8x tree's speed at 32 MiB in
        # two benchmarks, 0.8 in the tunes just before them; the trial races the two.
        # D0-G1 (ten runs): shm the best at 32 KiB in every run, both modes (native 0.87-0.92
        # of it in the median run), native at 8 KiB.
        "3": [[16 << 10, NATIVE], [None, "shm", "tree"]],
    },
}
for _rules in DEFAULT_TABLE.values():
    _rules.setdefault("default", _rules[min((k for k in _rules if k.isdigit()), key=int)])

# What a single-node algorithm becomes when the communicator spans several nodes.
MULTI_NODE = {"shm": {"allreduce": "hierarchical_shm", "default": "hierarchical"}}

# Collectives that move data without reducing it: every algorithm gives the same bytes.
MOVES = ("allgather", "broadcast")


def bits(collective: str, n: int, name: str, nbytes: int, single_node: bool = True,
         numa: bool = False) -> str:
    """Which combining order the reduction ``collective`` of ``nbytes`` on ``n`` ranks takes
    with algorithm ``name``: two algorithms of the same order give the same bits, whatever
    the data, dtype and op. The orders shared by more than one algorithm here:

    - ``"tree"``: each element combined as tree does on its way to the root, at each node of
      its in-order binary tree (``tree.pipelined``): tree's allreduce and reduce, and shm's
      (``shm._combine``), but for shm's allreduce above ``shm.WHOLE_MAX_BYTES``;
    - ``"ring"``: block k of ``split(count, n)`` (of the ``counts`` for a reduce-scatter)
      combined from rank k + 1 around to rank k (``ring.reduce_scatter``): ring's
      allreduce and reduce-scatter; shm's reduce-scatter, and its allreduce above
      ``shm.WHOLE_MAX_BYTES`` (``shm._fold``); hierarchical's, when its only level is the
      world (one node, ``single_node``, with no NUMA groups, ``numa``).

    ``hierarchical_shm`` on one node is shm. Any other algorithm's order is its own (MPI's
    own depends on the library). A test runs every pair of one order at n = 1..5 (the MPI
    tiers: tests/test_shm.py)."""
    from collectives import shm
    name = runs(name, single_node)
    if name == "shm" and collective in ("allreduce", "reduce_scatter", "reduce"):
        return shm.bits(collective, nbytes, n)
    if name == "tree" and collective in ("allreduce", "reduce"):
        return "tree"
    if collective in ("allreduce", "reduce_scatter") and \
            (name == "ring" or (name == "hierarchical" and single_node and not numa)):
        return "ring"
    return name


def runs(name: str, single_node: bool = True) -> str:
    """The algorithm that a call of ``name`` runs on host buffers: ``hierarchical_shm`` on one
    node is ``shm`` (``hierarchical.ShmNodes.launch``), so a race or a rule needs one of the
    two; any other, itself."""
    return "shm" if name == "hierarchical_shm" and single_node else name


def distinct(names, single_node: bool = True) -> tuple[str, ...]:
    """``names`` in order, each but the first of two for the same code (``runs``) left out:
    what a race runs, or a rule lists, once."""
    seen = {}
    for name in names:
        seen.setdefault(runs(name, single_node), name)
    return tuple(seen.values())


def races(collective: str, n: int, a: str, b: str, nbytes: int, single_node: bool = True,
          numa: bool = False) -> bool:
    """Whether ``auto`` may race ``a`` and ``b`` on ``n`` ranks for ``nbytes``, the choice
    changing no result (api._trials; the tuner's margins, bench.tune): 2 ranks (every
    algorithm reduces an element once, and a + b = b + a), data movement, or the same order
    (``bits``)."""
    if n <= 2 or collective in MOVES or a == b:
        return True
    return bits(collective, n, a, nbytes, single_node, numa) == \
        bits(collective, n, b, nbytes, single_node, numa)


def tuning_path() -> Path | None:
    """The tuning file ``auto`` reads, if any."""
    env = os.environ.get("COLLECTIVES_TUNING")
    if env:
        return Path(env)
    default = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / \
        "collectives" / "tuning.json"
    return default if default.exists() else None


_TABLE_CACHE: dict = {}


def load_table(reload: bool = False) -> dict:
    """The tuning table in force: the file's tables over ``DEFAULT_TABLE``.

    Read once per process (and again when ``COLLECTIVES_TUNING`` changes or ``reload``), so
    that ``auto`` costs no file-system call per collective.
    """
    key = getenv("COLLECTIVES_TUNING", b"COLLECTIVES_TUNING")
    if not reload and key in _TABLE_CACHE:
        return _TABLE_CACHE[key]
    _RULES.pop(key, None)  # rules memoized from an older read of this table
    path = tuning_path()
    table = {c: {k: dict(v) if isinstance(v, dict) else v for k, v in rules.items()}
             for c, rules in DEFAULT_TABLE.items()}
    if path is not None and path.exists():  # a file not written yet: the defaults
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, ValueError) as exc:
            raise ValueError(f"COLLECTIVES_TUNING={path}: cannot read tuning table: {exc}") \
                from None
        for collective, rules in data.get("tables", {}).items():
            mine = table.setdefault(collective, {})
            for key, value in rules.items():  # per communicator size, in place as well
                if isinstance(value, dict):
                    mine.setdefault(key, {}).update(value)
                else:
                    mine[key] = value
    _TABLE_CACHE.clear()
    _TABLE_CACHE[key] = table
    return table


_RULES: dict = {}


# The collectives whose ``"in-place"`` rules are used: those that are in place on every rank
# or on none (as MPI_IN_PLACE must be), so that every rank picks the same algorithm. Not
# ``reduce``: only its root can be in place.
IN_PLACE_RULES = ("allreduce",)


def _for_size(rules_by_size: dict, size: int):
    """The rules of ``size`` ranks: its own, the nearest smaller size's, or ``"default"``."""
    rules = rules_by_size.get(str(size))
    if rules is None:
        smaller = [int(k) for k in rules_by_size if k.isdigit() and int(k) < size]
        rules = rules_by_size[str(max(smaller))] if smaller else rules_by_size.get("default")
    return rules


def _rules(table, collective: str, size: int, inplace: bool = False) -> list:
    """The rules for ``size`` ranks (see the module doc), restricted to registered names."""
    rules_by_size = table.get(collective, {})
    rules = None
    if inplace and collective in IN_PLACE_RULES:
        rules = _for_size(rules_by_size.get("in-place") or {}, size)
    if rules is None:
        rules = _for_size(rules_by_size, size)
    _load_builtin()
    out = []
    for limit, *names in rules or ():
        names = tuple(n for n in names if n in REGISTRY[collective])
        if names:
            out.append((limit, names))
    return out


def auto(collective: str, nbytes: int, size: int, single_node=True, inplace=False) -> str:
    """The algorithm ``auto`` runs for ``nbytes`` per rank on ``size`` ranks (``inplace``:
    for a call with ``out=x``).

    ``single_node`` (a bool, or a callable that returns it, asked only when it matters): a
    single-node algorithm chosen for a communicator that spans nodes is replaced by its
    hierarchical counterpart.
    """
    return candidates(collective, nbytes, size, single_node, inplace)[0]


def candidates(collective: str, nbytes: int, size: int, single_node=True,
               inplace=False) -> tuple[str, ...]:
    """The algorithms of the rule for ``nbytes``: the first is what ``auto`` runs, the others
    are its alternates (see the module doc). Arguments as ``auto``; the API memoizes the
    result per communicator."""
    names = _pick(collective, nbytes, size, bool(inplace))
    if any(name in MULTI_NODE for name in names) and \
            not (single_node() if callable(single_node) else single_node):
        swapped = []
        for name in names:
            if name in MULTI_NODE:
                swap = MULTI_NODE[name]
                name = swap.get(collective, swap["default"])
                if name not in REGISTRY[collective]:
                    name = NATIVE
            swapped.append(name)
        names = tuple(dict.fromkeys(swapped))
    return names


def _pick(collective: str, nbytes: int, size: int, inplace: bool = False) -> tuple[str, ...]:
    """The table's algorithms for ``nbytes`` on ``size`` ranks, before ``MULTI_NODE``."""
    table = load_table()  # first: a (re)read drops the rules memoized from the old table
    memo = _RULES.setdefault(getenv("COLLECTIVES_TUNING", b"COLLECTIVES_TUNING"), {})
    rules = memo.get((collective, size, inplace))
    if rules is None:
        rules = memo[(collective, size, inplace)] = _rules(table, collective, size, inplace)
    for limit, names in rules:
        if limit is None or nbytes <= limit:
            return names
    return (NATIVE,)


def _bytes(n: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return f"{n / (1 << shift):.4g} {unit}"
    return f"{n} B"


def describe(rules) -> str:
    """A rule list in words, as the README's table of ``auto``'s choices prints it:
    ``[[32768, "native"], [None, "ring", "shm"]]`` -> ``native ≤ 32 KiB, ring (or shm)``."""
    words = []
    for limit, first, *others in rules:
        text = first.replace("_", " ")
        if others:
            text += f" (or {', '.join(o.replace('_', ' ') for o in others)})"
        words.append(text if limit is None else f"{text} ≤ {_bytes(limit)}")
    return ", ".join(words)
