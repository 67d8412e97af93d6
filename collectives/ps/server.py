"""A server rank's event loop: receive requests, apply pushes, answer pulls when consistent.

The loop blocks in a matched probe (``MPI_Mprobe``) for the next request header from any
worker, so an idle server sleeps inside MPI and takes no CPU time to speak of; it receives the
request's payload (``MPI_Mrecv`` of matched messages, so the sizes are checked before any byte
lands in a table), then:

1. a pull whose clock the slowest worker allows (``clock.ready``) is answered at once, others
   wait in a queue, answered in order as the slowest worker's clock advances;
2. a push is checked (table, dtype, size, keys) and acknowledged; the optimizer runs on it at
   once, or, for a BSP table, when the slowest worker passes the push's clock
   (``clock.PushBuffer``);
3. a worker's clock message may advance the slowest clock: held BSP pushes are applied, then
   the queued pulls that became consistent are answered;
4. when every worker has sent ``finish``, what is held is applied, the queue is answered (a
   finished worker counts as infinitely far ahead), the replies complete, and ``serve`` returns.

A rejected request leaves the tables as they were and gets a reply with a status code; the
worker raises ``TableError`` naming the table and the key. Replies are non-blocking sends,
completed as the loop goes, so a slow reader never stalls the others.

A queued pull that waits on workers not heard from is registered with the watchdog
(``watchdog.watch_local``), bounded by its settings (``COLLECTIVES_STALL_WARNING``,
``COLLECTIVES_TIMEOUT``) from the moment the last of those workers was heard: the watchdog
names them in a warning (kept in ``Server.warnings`` too), and past the timeout aborts the job
with its ``EXIT_CODE``, since the workers waiting on the laggard would otherwise hang.
"""
from __future__ import annotations

import json
import time

import numpy as np

from .. import p2p, watchdog
from . import protocol as P
from .clock import Clocks, PushBuffer, ready
from .store import make_shard

__all__ = ["Server", "TableState"]


class TableState:
    """A table as a server holds it: its spec, this server's shard, held BSP pushes."""

    def __init__(self, spec: dict, server: int, servers: int):
        self.spec = spec
        self.name = spec["name"]
        self.staleness = spec["staleness"]
        self.dtype = np.dtype(spec["dtype"])
        self.code = P.dtype_code(self.dtype)
        self.dim = spec["dim"]
        self.shard = make_shard(spec, server, servers)
        whole = (np.arange(self.shard.lo, self.shard.hi, dtype=np.int64)
                 if spec["kind"] == "dense" else None)
        self.held = PushBuffer(whole)

    def shard_rows(self) -> int:
        """Rows in a whole-shard request (dense tables)."""
        return self.shard.hi - self.shard.lo


class Server:
    """The event loop of one server rank over the job's communicator."""

    def __init__(self, comm, workers: int, server: int, servers: int):
        self.comm = comm
        self.workers = workers
        self.server = server
        self.servers = servers
        self.tables: list[TableState] = []
        self.names: dict[str, int] = {}
        self.clocks = Clocks(workers)
        self.queue: list = []     # (worker, request id, table, keys, clock, since)
        self.sends = p2p.Sends()  # replies in flight, with the buffers they read
        self.warnings: list[str] = []
        self.requests = 0

    # -- the loop ---------------------------------------------------------------------------
    def run(self) -> None:
        """Serve until every worker has finished."""
        from mpi4py import MPI
        hdr = np.empty(P.HEADER, dtype=np.int64)
        status = MPI.Status()
        stall = _Stall(self)
        try:
            while not self.clocks.all_done():
                msg = self.comm.Mprobe(MPI.ANY_SOURCE, P.TAG_REQUEST, status)
                msg.Recv([hdr, MPI.INT64_T])
                worker = status.Get_source()
                self.clocks.heard(worker)
                self.requests += 1
                self.handle(worker, hdr.copy())
                stall.update()
                if len(self.sends) >= 64:
                    self.reap()
            self.progress()
            self.sends.wait(f"parameter server: server rank {self.comm.Get_rank()}'s last "
                            f"replies", self.comm)
        finally:
            stall.end()

    def handle(self, worker: int, hdr: np.ndarray) -> None:
        """One request from ``worker``."""
        op, tid, rid, n, clock, flags, code = (int(v) for v in hdr[:7])
        if op == P.Op.CLOCK:
            if self.clocks.advance(worker, clock):
                self.progress()
        elif op == P.Op.FINISH:
            if self.clocks.finish(worker):
                self.progress()
        elif op in (P.Op.CREATE, P.Op.LOOKUP):
            text = self.recv_bytes(worker, n).decode()
            if op == P.Op.CREATE:
                self.create(worker, rid, json.loads(text))
            else:
                self.lookup(worker, rid, text)
        elif op == P.Op.PULL:
            self.pull(worker, rid, tid, n, clock, flags)
        elif op in (P.Op.PUSH, P.Op.ASSIGN):
            self.update(op, worker, rid, tid, n, clock, flags, code)
        else:
            raise RuntimeError(f"parameter server: unknown op {op} from rank {worker}")

    # -- payloads ---------------------------------------------------------------------------
    def recv_bytes(self, worker: int, n: int, tag: int = P.TAG_VALUES) -> bytes:
        """A payload of bytes (spec or name)."""
        buf = np.empty(n, np.uint8)
        p2p.recv(self.comm, buf, worker, tag, self._what(worker))
        return buf.tobytes()

    def _what(self, worker: int):
        """The server's task in words, made only when a report or an error needs it."""
        return lambda: f"parameter server: server rank {self.comm.Get_rank()} receiving a " \
                       f"request's payload from worker rank {worker}"

    def recv_array(self, worker: int, tag: int, dtype, count: int):
        """The next payload on ``tag`` as ``count`` items of ``dtype``, or (None, bytes) when
        its size differs (it is received all the same, so the stream stays in step)."""
        msg, status = p2p.probe(self.comm, worker, tag, self._what(worker))
        nbytes = status.Get_count(_mpi().BYTE)
        if nbytes != count * np.dtype(dtype).itemsize:
            msg.Recv([bytearray(nbytes), nbytes, _mpi().BYTE])
            return None, nbytes
        return p2p.recv_probed(msg, status, np.empty(count, dtype=dtype)), nbytes

    # -- replies ----------------------------------------------------------------------------
    def reply(self, worker: int, rid: int, status: int, detail: int = 0, data=None,
              with_data: bool = False) -> None:
        """Send the reply header (and the data message, when the op expects one)."""
        MPI = _mpi()
        h_tag, d_tag = P.reply_tags(rid)
        head = np.array([status, rid, detail, 0 if data is None else len(data)], dtype=np.int64)
        self.sends.add(self.comm.Isend([head, MPI.INT64_T], worker, h_tag), head)
        if with_data:
            body = np.empty(0, np.uint8) if data is None else np.ascontiguousarray(data)
            self.sends.add(p2p.isend(self.comm, body, worker, d_tag), body)

    def reap(self) -> None:
        """Drop the replies that have completed."""
        self.sends.reap()

    # -- ops --------------------------------------------------------------------------------
    def create(self, worker: int, rid: int, spec: dict) -> None:
        """Create a table, or check that the existing one of that name has the same spec."""
        name = spec["name"]
        if name in self.names:
            tid = self.names[name]
            same = self.tables[tid].spec == spec
            data = None if same else np.frombuffer(
                json.dumps(self.tables[tid].spec).encode(), np.uint8)
            self.reply(worker, rid, P.Status.OK if same else P.Status.MISMATCH, tid, data,
                       with_data=True)
            return
        self.names[name] = len(self.tables)
        self.tables.append(TableState(spec, self.server, self.servers))
        self.reply(worker, rid, P.Status.OK, self.names[name], with_data=True)

    def lookup(self, worker: int, rid: int, name: str) -> None:
        """A table's id and spec, or the names of the tables there are."""
        if name in self.names:
            tid = self.names[name]
            data = json.dumps(self.tables[tid].spec).encode()
            self.reply(worker, rid, P.Status.OK, tid, np.frombuffer(data, np.uint8), True)
        else:
            data = json.dumps(sorted(self.names)).encode()
            self.reply(worker, rid, P.Status.UNKNOWN_TABLE, -1, np.frombuffer(data, np.uint8),
                       True)

    def keys_of(self, worker: int, flags: int, n: int):
        """The request's keys (None for a whole dense shard)."""
        if flags & P.FLAG_WHOLE:
            return None, n == 0
        keys, _ = self.recv_array(worker, P.TAG_KEYS, np.int64, n)
        return keys, keys is not None

    def pull(self, worker, rid, tid, n, clock, flags) -> None:
        """Answer a pull now, or queue it until its clock is consistent."""
        keys, ok = self.keys_of(worker, flags, n)
        if not 0 <= tid < len(self.tables):
            return self.reply(worker, rid, P.Status.UNKNOWN_TABLE, tid, with_data=True)
        table = self.tables[tid]
        if not ok or (keys is None and table.spec["kind"] != "dense"):
            return self.reply(worker, rid, P.Status.BAD_SIZE, n, with_data=True)
        bad = table.shard.check(keys)
        if bad is not None:
            return self.reply(worker, rid, P.Status.OUT_OF_RANGE, bad, with_data=True)
        if ready(clock, table.staleness, self.clocks.slowest()):
            self.answer(worker, rid, table, keys)
        else:
            self.queue.append((worker, rid, table, keys, clock, time.monotonic()))

    def answer(self, worker, rid, table, keys) -> None:
        """Send the rows of ``keys``."""
        rows = table.shard.rows(keys)
        if keys is None:
            rows = rows.copy()   # a later push must not change the rows while they are sent
        self.reply(worker, rid, P.Status.OK, 0, rows, with_data=True)

    def update(self, op, worker, rid, tid, n, clock, flags, code) -> None:
        """Check a push or assign, acknowledge it, and apply it (or hold it, for BSP)."""
        keys, keys_ok = self.keys_of(worker, flags, n)
        table = self.tables[tid] if 0 <= tid < len(self.tables) else None
        dtype = table.dtype if table is not None else np.uint8
        whole = keys is None and table is not None and table.spec["kind"] == "dense"
        keys_ok = keys_ok and (keys is not None or whole)
        rows = table.shard_rows() if whole else n
        dim = table.dim if table is not None else 0
        values, nbytes = self.recv_array(worker, P.TAG_VALUES, dtype, rows * dim)
        if table is None:
            return self.reply(worker, rid, P.Status.UNKNOWN_TABLE, tid)
        if code != table.code:
            return self.reply(worker, rid, P.Status.BAD_DTYPE, table.code)
        if not keys_ok or values is None:
            return self.reply(worker, rid, P.Status.BAD_SIZE, nbytes)
        bad = table.shard.check(keys)
        if bad is not None:
            return self.reply(worker, rid, P.Status.OUT_OF_RANGE, bad)
        values = values.reshape(rows, dim)
        if op == P.Op.ASSIGN:
            table.shard.assign(keys, values)
        elif table.staleness == 0:
            table.held.add(clock, worker, keys, values)
        else:
            table.shard.apply(keys, values)
        self.reply(worker, rid, P.Status.OK)

    def progress(self) -> None:
        """Apply the held pushes the slowest clock allows, then answer the queued pulls."""
        slowest = self.clocks.slowest()
        for table in self.tables:
            for keys, grads in table.held.due(slowest):
                table.shard.apply(keys, grads)
        waiting = []
        for item in self.queue:
            worker, rid, table, keys, clock, _ = item
            if ready(clock, table.staleness, slowest):
                self.answer(worker, rid, table, keys)
            else:
                waiting.append(item)
        self.queue = waiting


class _Stall:
    """The watchdog's entry for the oldest queued pull while it waits on workers not heard
    from (``watchdog.watch_local``), kept up to date by the server's loop after each request:
    its start is when the last of those workers was heard, so the watchdog warns and aborts
    on their silence, not on a slow but live worker."""

    done = False  # as the watchdog reads a work's state: the entry is ended by ``end``

    def __init__(self, server: Server):
        self.server = server
        self.entry = None
        self.on = watchdog.enabled()

    def late(self):
        """``(oldest queued pull, the workers it waits for)``, or None."""
        server = self.server
        if not server.queue:
            return None
        pull = min(server.queue, key=lambda q: q[5])
        clocks, need = server.clocks, pull[4] - pull[2].staleness
        late = [w for w in range(len(clocks.clock))
                if not clocks.done[w] and clocks.clock[w] < need]
        return (pull, late) if late else None

    def update(self) -> None:
        """Register, move or end the entry after the server's state changed."""
        if not self.on:
            return
        found = self.late()
        if found is None:
            self.end()
            return
        (worker, _, table, _, clock, _), late = found
        what = (f"parameter server: worker rank {worker} waits in a pull of table "
                f"{table.name!r} at clock {clock} (staleness {table.staleness})")
        start = float(max(self.server.clocks.seen[w] for w in late))
        entry = self.entry
        if entry is None:
            entry = self.entry = watchdog.watch_local(self.server.comm, what, self,
                                                      self.server.warnings)
        elif entry.what == what and entry.start == start:
            return
        entry.restart(what, start)

    def waiting_for(self) -> str:
        found = self.late()
        if found is None:
            return "nothing (the pull is being answered)"
        clocks, now = self.server.clocks, time.monotonic()
        return ", ".join(f"worker rank {w} (at clock {clocks.clock[w]}, silent "
                         f"{now - clocks.seen[w]:.1f} s)" for w in found[1])

    def end(self) -> None:
        if self.entry is not None:
            self.entry.end()
            self.entry = None


def _mpi():
    from mpi4py import MPI
    return MPI
