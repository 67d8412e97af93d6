"""The timeline: a Chrome trace of every collective, every DDP bucket and the training phases.

    COLLECTIVES_TIMELINE=trace.json mpiexec -n 3 python train.py
    # rank r writes trace.r.json (trace.json on one rank; "{rank}" in the path is replaced)

The files are in the JSON trace-event format that Perfetto (ui.perfetto.dev) and
chrome://tracing open: ``{"traceEvents": [...]}``, each event with ``name``, ``ph`` (``X``: a
span with ``dur``; ``i``: an instant), ``ts`` in microseconds of the wall clock (so the ranks
of one node line up when their files are opened together), ``pid`` (the rank) and ``tid`` (the
thread). Collectives are category ``collective`` with ``args`` algorithm, bytes, and whether
they were non-blocking (their span ends when completion was seen); DDP adds ``bucket`` events
(``ready`` and ``started`` instants, a ``reduce`` span to done) and ``phase`` spans (forward,
backward, optimizer).

When the variable is unset, the only cost anywhere is the test of the module flag ``on``.
Events are kept in memory and written once, at exit (or by ``flush()``).
"""
from __future__ import annotations

import atexit
import json
import os
import threading
import time

from . import config

__all__ = ["on", "start", "flush", "now", "span_event", "instant", "events", "path_for"]

on = False  # tested inline by the callers: the whole cost when the timeline is off
_path = None
_events: list = []
_tids: dict = {}
_rank = None


def now() -> float:
    """The current time in microseconds (wall clock: the ranks of a node share it)."""
    return time.time_ns() / 1000.0


def _tid() -> int:
    ident = threading.get_ident()
    tid = _tids.get(ident)
    if tid is None:
        tid = _tids[ident] = len(_tids)
    return tid


def _pid() -> int:
    global _rank
    if _rank is None:
        try:
            from mpi4py import MPI
            _rank = MPI.COMM_WORLD.Get_rank() if MPI.Is_initialized() else 0
        except ImportError:  # pragma: no cover - mpi4py is a dependency
            _rank = 0
    return _rank


def span_event(name: str, cat: str, t0: float, t1: float, args=None) -> None:
    """Record a span from ``t0`` to ``t1`` (``now()`` values)."""
    ev = {"name": name, "cat": cat, "ph": "X", "ts": t0, "dur": max(t1 - t0, 0.0),
          "pid": _pid(), "tid": _tid()}
    if args:
        ev["args"] = args
    _events.append(ev)  # list.append is atomic: the progress thread may record too


def instant(name: str, cat: str, args=None) -> None:
    """Record an instant event now."""
    ev = {"name": name, "cat": cat, "ph": "i", "s": "t", "ts": now(), "pid": _pid(),
          "tid": _tid()}
    if args:
        ev["args"] = args
    _events.append(ev)


def events() -> list:
    """The events recorded so far (not yet written)."""
    return list(_events)


def path_for(path: str, rank: int, size: int) -> str:
    """Rank ``rank``'s file: ``{rank}`` replaced, else ``.rank`` before the suffix if n > 1."""
    if "{rank}" in path:
        return path.replace("{rank}", str(rank))
    if size == 1:
        return path
    stem, ext = os.path.splitext(path)
    return f"{stem}.{rank}{ext or '.json'}"


def start(path: str) -> None:
    """Record from now on and write the trace to ``path`` (see ``path_for``) at exit."""
    global on, _path
    if not on:
        atexit.register(flush)
    _path = path
    on = True


def flush() -> str | None:
    """Write every event recorded so far to this rank's file; returns its path."""
    if _path is None:
        return None
    size = 1
    try:
        from mpi4py import MPI
        if MPI.Is_initialized() and not MPI.Is_finalized():
            size = MPI.COMM_WORLD.Get_size()
    except ImportError:  # pragma: no cover
        pass
    target = path_for(_path, _pid(), size)
    meta = [{"name": "process_name", "ph": "M", "ts": 0, "pid": _pid(), "tid": 0,
             "args": {"name": f"rank {_pid()}"}}]
    with open(target, "w") as f:
        json.dump({"traceEvents": meta + list(_events), "displayTimeUnit": "ms"}, f)
    return target


_configured = config.get("COLLECTIVES_TIMELINE")
if _configured:
    start(_configured)
