"""``Schedule.direct``: out of place, receives land straight in the reduction that consumes
them. The rewrite must give bitwise the same result as the schedule it came from, never make a
receive wait for anything new, and leave alone every pair where skipping the scratch would be
wrong."""
import numpy as np
import pytest

from collectives import select
from collectives.ops import resolve
from collectives.schedule import IN, OUT, RECV, REDUCE, TMP, Schedule
from collectives.sim import run_schedules
from test_cost_model import _closure as _ancestors  # every op each op waits for

# The collectives that reduce or copy one buffer's elements (all-to-all, gather and scatter
# have their own suite, tests/test_alltoall.py, and no reduction for direct() to rewrite).
COLLECTIVES = ["allreduce", "reduce", "broadcast", "reduce_scatter", "allgather"]


def _builders():
    for collective in COLLECTIVES:
        for name in select.algorithms(collective):
            algo = select.get(collective, name)
            if algo.kind == select.SCHEDULE:
                yield collective, name, algo.build[collective]


def _build(collective, builder, r, n, count, seg):
    if collective == "allreduce":
        return builder(r, n, count, seg=seg)
    if collective in ("reduce", "broadcast"):
        return builder(r, n, count, n - 1, seg=seg)
    counts = tuple(count // n + (1 if k < count % n else 0) for k in range(n))
    return builder(r, n, counts, seg=seg)


def _run(schedules, op, direct):
    rng = np.random.default_rng(len(schedules))
    ins = [rng.standard_normal(s.count_in).astype(np.float32) for s in schedules]
    outs = [np.full(s.count_out, np.nan, np.float32) for s in schedules]
    run_schedules(schedules, ins, outs, resolve(op, np.dtype(np.float32)), direct=direct)
    return outs


@pytest.mark.parametrize("collective,name,builder", list(_builders()),
                         ids=[f"{c}-{n}" for c, n, _ in _builders()])
@pytest.mark.parametrize("n", [2, 3, 4, 5, 7])
def test_direct_is_bitwise_the_same(collective, name, builder, n):
    for count, seg in ((1, None), (n + 1, 1), (37, 5), (200, None)):
        schedules = [_build(collective, builder, r, n, count, seg) for r in range(n)]
        for op in ("sum", "max"):
            plain = _run(schedules, op, direct=False)
            direct = _run(schedules, op, direct=True)
            for r in range(n):
                assert plain[r].tobytes() == direct[r].tobytes(), (name, n, count, seg, op, r)


@pytest.mark.parametrize("collective,name,builder", list(_builders()),
                         ids=[f"{c}-{n}" for c, n, _ in _builders()])
def test_direct_receives_wait_for_nothing_new(collective, name, builder):
    """A rewritten receive depends on no op its original did not: no new wait, no deadlock."""
    for n in (2, 3, 5, 8):
        for r in range(n):
            s = _build(collective, builder, r, n, 41, 4)
            d = s.direct()
            if d is s:
                continue
            s.alias = False  # what direct() assumes: IN and OUT are separate memory
            before, after = _ancestors(s.deps()), _ancestors(d.deps())
            for i, op in enumerate(d.ops):
                if op.kind == RECV:
                    assert after[i] <= before[i], (name, n, r, i)


def _tmp_reduces(s):
    return sum(1 for op in s.ops if op.kind == REDUCE and any(b == TMP for b, _, _ in op.srcs))


@pytest.mark.parametrize("n", [2, 3, 8])
def test_ring_allreduce_needs_no_scratch_out_of_place(n):
    s = select.get("allreduce", "ring").build["allreduce"](0, n, 1000, seg=64)
    assert _tmp_reduces(s) > 0 and s.tmp > 0
    d = s.direct()
    assert _tmp_reduces(d) == 0 and d.tmp == 0
    assert s.plan(direct=True).schedule is d or s.plan(direct=True).schedule.ops == d.ops


def _pair(extra):
    """recv(TMP); [extra ops]; reduce(OUT = IN op TMP): ``extra`` may spoil the rewrite."""
    s = Schedule(0, 2, 8)
    s.tmp = 8
    for kind, region in extra.get("before", ()):
        getattr(s, kind)(1, region)
    s.recv(1, (TMP, 0, 4))
    for kind, region in extra.get("between", ()):
        getattr(s, kind)(1, region)
    s.reduce(extra.get("dst", (OUT, 0, 4)), (IN, 0, 4), (TMP, 0, 4))
    for kind, region in extra.get("after", ()):
        getattr(s, kind)(1, region)
    return s


def test_direct_rewrites_the_plain_pair():
    d = _pair({}).direct()
    assert d.ops[0] == (RECV, 1, (OUT, 0, 4), ())
    assert d.ops[1] == (REDUCE, -1, (OUT, 0, 4), ((IN, 0, 4), (OUT, 0, 4)))


@pytest.mark.parametrize("spoiler", [
    {"after": [("send", (TMP, 0, 4))]},        # the received value is read again
    {"after": [("send", (TMP, 2, 3))]},        # ... or a part of it
    {"between": [("send", (OUT, 0, 4))]},      # D is read before the reduction writes it
    {"before": [("recv", (OUT, 2, 6))]},       # D was written before: the receive would wait
    {"dst": (TMP, 2, 6)},                      # D overlaps the received region itself
])
def test_direct_leaves_unsafe_pairs_alone(spoiler):
    s = _pair(spoiler)
    assert s.direct() is s
