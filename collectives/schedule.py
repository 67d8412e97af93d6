"""The Schedule: what one rank does in one collective, as a small DAG of operations.

An algorithm is a pure function ``(rank, size, count, ...) -> Schedule``. It appends operations in
*program order*, as if it were a sequential program that blocks on nothing:

- ``send(peer, region)``            the bytes of ``region`` go to ``peer``
- ``recv(peer, region)``            the next message from ``peer`` lands in ``region``
- ``reduce(dst, a, b)``             ``dst = a (op) b`` element-wise (``dst`` may be ``a`` or ``b``)
- ``copy(dst, src)``                ``dst = src``

A region is ``(buffer, start, stop)`` in *elements* of one of three buffers: ``IN`` (the caller's
input, never written), ``OUT`` (the result) and ``TMP`` (scratch owned by the executor, sized by
``Schedule.tmp``). When a schedule is run in place, ``IN`` and ``OUT`` are the same memory, so for
schedules whose ``IN`` and ``OUT`` have the same length the two are treated as one buffer when
dependencies are computed (``alias``); an algorithm must therefore never read ``IN[k]`` after it
wrote ``OUT[k]`` expecting the original input.

Dependencies are not written by hand: ``deps()`` derives them from region overlaps (read after
write, write after read, write after write) in program order, so the DAG allows exactly the
reordering that cannot change the result. Messages between a pair of ranks match in program
order: the executors post the sends to one peer, and the receives from one peer, in the order the
schedule lists them. Empty regions are dropped at construction, identically on both sides of a
message, so chunk splits may leave empty chunks (``count < size``).
"""
from __future__ import annotations

from bisect import bisect_right

__all__ = [
    "IN", "OUT", "TMP", "SEND", "RECV", "REDUCE", "COPY",
    "Schedule", "Op", "split", "segments", "build",
]

IN, OUT, TMP = 0, 1, 2
BUFFER_NAMES = ("IN", "OUT", "TMP")
SEND, RECV, REDUCE, COPY = 0, 1, 2, 3


def split(count: int, parts: int) -> list[int]:
    """Boundaries of ``count`` elements split in ``parts`` balanced chunks (numpy.array_split).

    Returns ``parts + 1`` offsets; chunk ``k`` is ``[b[k], b[k+1])``. The first ``count % parts``
    chunks are one element longer; chunks may be empty.
    """
    q, r = divmod(count, parts)
    bounds = [0] * (parts + 1)
    for k in range(parts):
        bounds[k + 1] = bounds[k] + q + (1 if k < r else 0)
    return bounds


def offsets(counts) -> list[int]:
    """Prefix sums of ``counts``: ``parts + 1`` boundaries."""
    bounds = [0]
    for c in counts:
        bounds.append(bounds[-1] + c)
    return bounds


def segments(start: int, stop: int, seg: int | None):
    """Yield ``(a, b)`` pieces of ``[start, stop)`` no longer than ``seg`` (None: one piece)."""
    if seg is None or seg <= 0 or stop - start <= seg:
        if stop > start:
            yield start, stop
        return
    for a in range(start, stop, seg):
        yield a, min(a + seg, stop)


class Op(tuple):
    """One operation: ``(kind, peer, dst, srcs)``; regions are ``(buffer, start, stop)``."""

    __slots__ = ()

    kind = property(lambda self: self[0])
    peer = property(lambda self: self[1])
    dst = property(lambda self: self[2])
    srcs = property(lambda self: self[3])

    def nelems(self) -> int:
        region = self[2] if self[2] is not None else self[3][0]
        return region[2] - region[1]

    def __repr__(self):
        def reg(r):
            return f"{BUFFER_NAMES[r[0]]}[{r[1]}:{r[2]}]"
        kind, peer, dst, srcs = self
        if kind == SEND:
            return f"send({reg(srcs[0])} -> rank {peer})"
        if kind == RECV:
            return f"recv({reg(dst)} <- rank {peer})"
        if kind == REDUCE:
            return f"reduce({reg(dst)} = {reg(srcs[0])} op {reg(srcs[1])})"
        return f"copy({reg(dst)} = {reg(srcs[0])})"


class Schedule:
    """The operations of one rank in one collective, in program order (see the module doc).

    ``count_in``/``count_out`` are the element counts of ``IN`` and ``OUT``; ``tmp`` the scratch
    elements needed. ``alias`` says IN and OUT may be the same memory (same length).
    """

    __slots__ = ("rank", "size", "count_in", "count_out", "tmp", "alias", "ops", "_plan",
                 "_direct", "name")

    def __init__(self, rank: int, size: int, count_in: int, count_out: int | None = None,
                 *, name: str = ""):
        self.rank, self.size, self.name = rank, size, name
        self.count_in = count_in
        self.count_out = count_in if count_out is None else count_out
        self.alias = self.count_out == self.count_in
        self.tmp = 0
        self.ops: list[Op] = []
        self._plan = None
        self._direct = None

    # -- building -------------------------------------------------------------------------
    def scratch(self, n: int) -> int:
        """Reserve ``n`` more TMP elements; returns their offset."""
        start = self.tmp
        self.tmp += n
        return start

    def send(self, peer: int, region) -> None:
        if region[2] > region[1]:
            assert peer != self.rank and 0 <= peer < self.size, (peer, self.rank)
            self.ops.append(Op((SEND, peer, None, (tuple(region),))))

    def recv(self, peer: int, region) -> None:
        if region[2] > region[1]:
            assert peer != self.rank and 0 <= peer < self.size, (peer, self.rank)
            self.ops.append(Op((RECV, peer, tuple(region), ())))

    def reduce(self, dst, a, b) -> None:
        if dst[2] > dst[1]:
            assert dst[2] - dst[1] == a[2] - a[1] == b[2] - b[1], (dst, a, b)
            self.ops.append(Op((REDUCE, -1, tuple(dst), (tuple(a), tuple(b)))))

    def copy(self, dst, src) -> None:
        if dst[2] > dst[1] and tuple(dst) != tuple(src):
            assert dst[2] - dst[1] == src[2] - src[1], (dst, src)
            self.ops.append(Op((COPY, -1, tuple(dst), (tuple(src),))))

    # -- analysis ---------------------------------------------------------------------------
    def deps(self) -> list[tuple[int, ...]]:
        """For each op, the earlier ops it must wait for (derived from region overlaps).

        Each buffer keeps disjoint intervals with their last writer and the readers since, so
        an access costs O(log ops): a 4096-rank ring schedule (8k ops) takes a fraction of a
        second. A read follows the interval's writer; a write follows the writer and readers.
        """
        maps = {IN: _Intervals(), OUT: _Intervals(), TMP: _Intervals()}
        if self.alias:
            maps[IN] = maps[OUT]
        result = []
        for i, (_kind, _peer, dst, srcs) in enumerate(self.ops):
            need: set[int] = set()
            # Reads first, then the write: an op that reads and writes one region follows
            # only earlier ops (itself is dropped below).
            for buf, a, b in srcs:
                maps[buf].access(a, b, i, False, need)
            if dst is not None:
                maps[dst[0]].access(dst[1], dst[2], i, True, need)
            need.discard(i)
            result.append(tuple(sorted(need)))
        return result

    def plan(self, direct: bool = False):
        """The compiled form executors run (cached): see ``Plan``.

        ``direct``: the plan of ``self.direct()``, for a run whose IN and OUT are separate
        memory (out of place); the executor must not use it in place.
        """
        if direct:
            if self._direct is None:
                self._direct = self.direct()
            if self._direct is not self:
                return self._direct.plan()
        if self._plan is None:
            self._plan = Plan(self)
        return self._plan

    def direct(self) -> Schedule:
        """This schedule with receives landing straight in the reduction that consumes them.

        ``recv(TMP t) ... reduce(D, X, TMP t)`` becomes ``recv(D) ... reduce(D, X, D)``: the
        scratch round trip is gone and the reduction has two operands, one of them its output.
        On this machine kind that is the difference between 1.1-1.3 ms and 0.64 ms for an
        8 MiB float32 add (a third array costs a whole extra memory stream), which is most of a
        ring allreduce's reduce-scatter at n = 2. The operands keep their order, so the result
        is bitwise the same.

        Valid only when IN and OUT are separate memory (``alias`` is dropped). A pair is
        rewritten only when nothing else reads the received value and no earlier op touches
        ``D`` (so the receive gains no dependency: no new wait, no possible deadlock) and ``D``
        does not overlap the other operand. Returns ``self`` when no pair qualifies.
        """
        ops = list(self.ops)
        touched = {IN: _Touched(), OUT: _Touched(), TMP: _Touched()}  # of OUT and TMP
        writer: dict[tuple, int] = {}   # exact TMP region -> the RECV that last wrote it
        readers: dict[int, int] = {}    # that RECV -> how many ops read its region
        candidates = []
        for k, (kind, _peer, dst, srcs) in enumerate(ops):
            if kind == REDUCE and dst[0] != IN:
                for t, x in ((srcs[1], srcs[0]), (srcs[0], srcs[1])):
                    r = writer.get(t)
                    if (r is not None and t[0] == TMP and not touched[dst[0]].hit(dst)
                            and not _overlap(dst, x) and not _overlap(dst, t)):
                        candidates.append((r, k, t))
                        break
            for region in srcs:
                if region[0] != IN:
                    touched[region[0]].add(region)
                if region[0] == TMP:
                    for key, r in writer.items():
                        if _overlap(key, region):
                            readers[r] = readers.get(r, 0) + 1
            if dst is not None:
                touched[dst[0]].add(dst)
                if dst[0] == TMP:
                    for key in [key for key in writer if _overlap(key, dst)]:
                        r = writer.pop(key)
                        # the parts not overwritten still hold the received value
                        if key[1] < dst[1]:
                            writer[(TMP, key[1], dst[1])] = r
                        if dst[2] < key[2]:
                            writer[(TMP, dst[2], key[2])] = r
                    if kind == RECV:
                        writer[dst] = k
        rewritten = 0
        for r, k, t in candidates:
            if readers.get(r) != 1:  # the received value is also read elsewhere
                continue
            _kind, peer, _dst, _srcs = ops[r]
            dst = ops[k][2]
            ops[r] = Op((RECV, peer, dst, ()))
            ops[k] = Op((REDUCE, -1, dst, tuple(dst if src == t else src for src in ops[k][3])))
            rewritten += 1
        if not rewritten:
            return self
        out = Schedule(self.rank, self.size, self.count_in, self.count_out,
                       name=f"{self.name} (direct)")
        out.alias = False
        out.ops = ops
        out.tmp = max((region[2] for op in ops
                       for region in op[3] + ((op[2],) if op[2] is not None else ())
                       if region[0] == TMP), default=0)
        return out

    def validate(self) -> None:
        """Check regions lie inside their buffers and IN is never written."""
        limits = (self.count_in, self.count_out, self.tmp)
        for op in self.ops:
            regions = list(op.srcs) + ([op.dst] if op.dst is not None else [])
            for buf, a, b in regions:
                if not (0 <= a < b <= limits[buf]):
                    raise ValueError(f"{self.name}: {op!r} outside {BUFFER_NAMES[buf]} "
                                     f"of {limits[buf]} elements")
            if op.dst is not None and op.dst[0] == IN:
                raise ValueError(f"{self.name}: {op!r} writes the input")

    def messages(self) -> tuple[int, int]:
        """(messages sent, elements sent) by this rank."""
        sends = [op for op in self.ops if op.kind == SEND]
        return len(sends), sum(op.nelems() for op in sends)

    def __len__(self):
        return len(self.ops)

    def __repr__(self):
        lines = [f"Schedule {self.name} rank {self.rank}/{self.size} in={self.count_in} "
                 f"out={self.count_out} tmp={self.tmp}"]
        lines += [f"  {i:3d} {op!r}" for i, op in enumerate(self.ops)]
        return "\n".join(lines)


class Plan:
    """A schedule compiled for execution: dependency counts, dependents, per-peer order.

    ``ndeps[i]``: how many ops op ``i`` waits for; ``users[i]``: the ops waiting for ``i``;
    ``order[i]``: the position of a send/recv in its (peer, direction) queue; ``queues``:
    ``{(kind, peer): [op indices in program order]}``; for a send/recv, ``keys[i]`` is its
    queue's key and ``msg[i]`` the region its bytes leave from or land in (the executor's
    per-message lookups, done once here).
    """

    __slots__ = ("ops", "ndeps", "users", "order", "queues", "roots", "schedule", "keys", "msg")

    def __init__(self, schedule: Schedule):
        self.schedule = schedule
        self.ops = schedule.ops
        deps = schedule.deps()
        self.ndeps = [len(d) for d in deps]
        self.users: list[list[int]] = [[] for _ in self.ops]
        for i, d in enumerate(deps):
            for j in d:
                self.users[j].append(i)
        self.queues: dict[tuple[int, int], list[int]] = {}
        self.order = [0] * len(self.ops)
        self.keys: list = [None] * len(self.ops)
        self.msg: list = [None] * len(self.ops)
        for i, op in enumerate(self.ops):
            if op[0] in (SEND, RECV):
                key = self.keys[i] = (op[0], op[1])
                self.msg[i] = op[3][0] if op[0] == SEND else op[2]
                q = self.queues.setdefault(key, [])
                self.order[i] = len(q)
                q.append(i)
        self.roots = [i for i, n in enumerate(self.ndeps) if n == 0]


def _overlap(a, b) -> bool:
    """Whether regions ``a`` and ``b`` share an element (same buffer, intersecting ranges)."""
    return a[0] == b[0] and a[1] < b[2] and b[1] < a[2]


class _Touched:
    """The union of the ranges of one buffer accessed so far (sorted, merged)."""

    __slots__ = ("lo", "hi")

    def __init__(self):
        self.lo: list[int] = []
        self.hi: list[int] = []

    def hit(self, region) -> bool:
        j = bisect_right(self.hi, region[1])
        return j < len(self.lo) and self.lo[j] < region[2]

    def add(self, region) -> None:
        a, b = region[1], region[2]
        lo, hi = self.lo, self.hi
        j0 = bisect_right(hi, a - 1)    # first range ending at or after a (touching merges)
        j1 = j0
        while j1 < len(lo) and lo[j1] <= b:
            a, b = min(a, lo[j1]), max(b, hi[j1])
            j1 += 1
        lo[j0:j1], hi[j0:j1] = [a], [b]


class _Intervals:
    """Disjoint sorted intervals of one buffer: the last writer and the readers since."""

    __slots__ = ("lo", "hi", "w", "r")

    def __init__(self):
        self.lo: list[int] = []
        self.hi: list[int] = []
        self.w: list[int] = []
        self.r: list[list[int]] = []

    def access(self, a, b, i, writes, need):
        """Add the ops that an access of ``[a, b)`` by op ``i`` must follow to ``need``, then
        record the access."""
        lo, hi, w, r = self.lo, self.hi, self.w, self.r
        if not lo or a >= hi[-1]:  # past every interval: the common case of a fresh region
            lo.append(a), hi.append(b), w.append(i if writes else -1)
            r.append([] if writes else [i])
            return
        j0 = bisect_right(hi, a)
        j1 = j0
        while j1 < len(lo) and lo[j1] < b:
            if w[j1] >= 0:
                need.add(w[j1])
            if writes:
                need.update(r[j1])
            j1 += 1
        if j1 == j0 + 1 and lo[j0] == a and hi[j0] == b:  # exactly one known interval
            if writes:
                w[j0], r[j0] = i, []
            else:
                r[j0].append(i)
            return
        new_lo, new_hi, new_w, new_r = [], [], [], []
        if j0 < j1 and lo[j0] < a:  # the part of the first interval before a stays as it was
            new_lo.append(lo[j0]), new_hi.append(a), new_w.append(w[j0]), new_r.append(r[j0])
        if writes:
            new_lo.append(a), new_hi.append(b), new_w.append(i), new_r.append([])
        else:
            at = a
            for j in range(j0, j1):
                if lo[j] > at:  # a gap never accessed before
                    new_lo.append(at), new_hi.append(lo[j]), new_w.append(-1), new_r.append([i])
                s, e = max(lo[j], a), min(hi[j], b)
                new_lo.append(s), new_hi.append(e), new_w.append(w[j]), new_r.append(r[j] + [i])
                at = e
            if at < b:
                new_lo.append(at), new_hi.append(b), new_w.append(-1), new_r.append([i])
        if j0 < j1 and hi[j1 - 1] > b:
            new_lo.append(b), new_hi.append(hi[j1 - 1]), new_w.append(w[j1 - 1])
            new_r.append(list(r[j1 - 1]))
        lo[j0:j1], hi[j0:j1], w[j0:j1], r[j0:j1] = new_lo, new_hi, new_w, new_r


def build(builder, collective: str, rank: int, size: int, count: int, counts, root: int,
          seg: int | None, **kwargs) -> Schedule:
    """``builder``'s schedule for ``rank``, called with the arguments its collective takes: the
    per-rank element ``count`` (allreduce; reduce and broadcast also ``root``), every rank's
    ``counts`` (reduce_scatter, allgather; gather and scatter also ``root``), or for alltoall
    ``(send, recv, matrix)``: this rank's counts to and from each rank, and every rank's send
    counts (None when not known)."""
    if collective == "allreduce":
        return builder(rank, size, count, seg=seg, **kwargs)
    if collective in ("reduce", "broadcast"):
        return builder(rank, size, count, root, seg=seg, **kwargs)
    if collective in ("reduce_scatter", "allgather"):
        return builder(rank, size, counts, seg=seg, **kwargs)
    if collective in ("gather", "scatter"):
        return builder(rank, size, counts, root, seg=seg, **kwargs)
    if collective == "alltoall":  # counts: (this rank's send, its recv, every rank's or None)
        return builder(rank, size, counts[0], counts[1], seg=seg, matrix=counts[2], **kwargs)
    raise ValueError(f"unknown collective {collective!r}")
