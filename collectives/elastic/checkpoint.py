"""Asynchronous sharded checkpoints of committed state, every ``k`` steps, loadable at any size.

    ckpt = Checkpointer("/ckpt", every=5)        # collective only in load_newest
    ckpt.attach(state)                           # every 5th commit goes to disk
    ckpt.load_newest(state)                      # where a job starts: the newest complete one
    ...
    ckpt.close()                                 # waits for the writes in flight

Layout: ``DIR/step-00000015/`` holds, for a checkpoint written by N ranks, ``shard-R-of-N.pt``
for every rank R and a marker ``done-R`` written after its shard; a checkpoint is *complete*
when all N markers are there, and only complete ones are read. The state is cut by tensor:
the model's tensors and the optimizer's per-parameter state are dealt out to the N ranks by
size (largest first, each to the rank with the fewest bytes so far), rank 0 adds the
optimizer's parameter groups, the data's state and the extras; every rank writes only its
part. Reading takes every shard of the newest complete checkpoint, whatever N was, and puts the
whole state back together: written at 4 ranks, it loads at 3.

Asynchronous: a commit is already a copy (``State.commit``), so the training loop only hands
it to a writer thread (``checkpoint_ms`` in the example measures that hand-off and the split);
the thread saves the shard (``save``: a pickled header of the structure, then the tensors'
bytes as they are in memory, written in chunks that release the interpreter's lock; to a
temporary name, then a rename, then the marker). A job that starts from the newest complete
checkpoint first removes the incomplete ones after it (``load_newest``). At most one
checkpoint is in flight: a commit due while the previous one is still being written waits for
it. Old complete checkpoints beyond ``keep`` are removed by rank 0.
"""
from __future__ import annotations

import os
import queue
import re
import shutil
import threading
import time

__all__ = ["Checkpointer", "newest", "read", "save", "load"]

_STEP = re.compile(r"^step-(\d+)$")
_SHARD = re.compile(r"^shard-(\d+)-of-(\d+)\.pt$")


def _complete(path: str) -> bool:
    try:
        names = os.listdir(path)
    except OSError:
        return False
    sizes = {int(m.group(2)) for m in map(_SHARD.match, names) if m}
    if len(sizes) != 1:
        return False
    n = sizes.pop()
    return all(f"done-{r}" in names and f"shard-{r}-of-{n}.pt" in names for r in range(n))


def newest(directory: str) -> tuple[int, str] | None:
    """``(next_step, path)`` of the newest complete checkpoint in ``directory``, or None."""
    try:
        names = os.listdir(directory)
    except OSError:
        return None
    found = sorted((int(m.group(1)), m.group(0)) for m in map(_STEP.match, names) if m)
    for step, name in reversed(found):
        path = os.path.join(directory, name)
        if _complete(path):
            return step, path
    return None


def _deal(sizes: dict, n: int) -> dict:
    """Keys to ranks: largest first, each to the rank with the fewest bytes so far."""
    load, owner = [0] * n, {}
    for key in sorted(sizes, key=lambda k: (-sizes[k], str(k))):
        r = min(range(n), key=lambda i: (load[i], i))
        owner[key] = r
        load[r] += sizes[key]
    return owner


def _nbytes(value) -> int:
    if hasattr(value, "element_size"):
        return value.numel() * value.element_size()
    if isinstance(value, dict):
        return sum(_nbytes(v) for v in value.values())
    return 8


def split(commit, rank: int, n: int) -> dict:
    """This rank's part of ``commit`` (see the module doc)."""
    part = {"next_step": commit.next_step, "model": {}, "optimizer_state": {}}
    if commit.model is not None:
        owner = _deal({k: _nbytes(v) for k, v in commit.model.items()}, n)
        part["model"] = {k: v for k, v in commit.model.items() if owner[k] == rank}
    if commit.optimizer is not None:
        st = commit.optimizer.get("state", {})
        owner = _deal({k: _nbytes(v) for k, v in st.items()}, n)
        part["optimizer_state"] = {k: v for k, v in st.items() if owner[k] == rank}
    if rank == 0:
        part["has_model"] = commit.model is not None
        part["optimizer_groups"] = None if commit.optimizer is None else \
            commit.optimizer.get("param_groups")
        part["data"], part["extra"] = commit.data, commit.extra
    return part


class _Ref:
    """Where a tensor was in a shard's structure: its index among the shard's tensors."""

    __slots__ = ("index",)

    def __init__(self, index: int):
        self.index = index


def _walk(value, leaf):
    """``value`` made again with ``leaf(x)`` in place of each tensor or ``_Ref`` in it (in
    dicts, lists, tuples and saved extras)."""
    from .state import Saved
    if isinstance(value, dict):
        return {k: _walk(v, leaf) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_walk(v, leaf) for v in value)
    if isinstance(value, Saved):
        return Saved(_walk(value.state, leaf))
    if isinstance(value, _Ref) or hasattr(value, "untyped_storage"):
        return leaf(value)
    return value


def _strip(value, tensors: list):
    """``value`` with each tensor put in ``tensors`` and replaced by a ``_Ref``."""
    def put(t):
        tensors.append(t.detach().contiguous())
        return _Ref(len(tensors) - 1)
    return _walk(value, put)


def save(part, path: str) -> None:
    """Write a shard: a small pickled header (the structure, each tensor's dtype and shape),
    then every tensor's bytes as they are in memory, in chunks. Each chunk is a ``write`` that
    releases the interpreter's lock while the kernel copies it, so a training loop beside the
    writer thread is not held up (``torch.save`` keeps the lock while it serializes and
    checksums)."""
    import pickle
    import struct
    tensors: list = []
    header = pickle.dumps((_strip(part, tensors),
                           [(str(t.dtype).removeprefix("torch."), tuple(t.shape))
                            for t in tensors]), protocol=pickle.HIGHEST_PROTOCOL)
    with open(path, "wb") as f:
        f.write(_MAGIC + struct.pack("<Q", len(header)))
        f.write(header)
        for t in tensors:
            data = memoryview(t.reshape(-1).view(_torch().uint8).numpy())
            for at in range(0, len(data), _CHUNK):
                f.write(data[at:at + _CHUNK])


def load(path: str):
    """A shard that ``save`` wrote."""
    import pickle
    import struct
    torch = _torch()
    with open(path, "rb") as f:
        head = f.read(len(_MAGIC) + 8)
        if head[:len(_MAGIC)] != _MAGIC:
            raise ValueError(f"{path} is not a checkpoint shard of collectives.elastic")
        structure, metas = pickle.loads(f.read(struct.unpack("<Q", head[len(_MAGIC):])[0]))
        tensors = []
        for dtype, shape in metas:
            dtype = getattr(torch, dtype)
            size = dtype.itemsize
            for d in shape:
                size *= d
            buf = bytearray(size)
            if f.readinto(buf) != size:
                raise ValueError(f"{path} ends inside a tensor")
            raw = torch.frombuffer(buf, dtype=torch.uint8) if size else \
                torch.empty(0, dtype=torch.uint8)
            tensors.append(raw.view(dtype).reshape(shape))
    return _walk(structure, lambda ref: tensors[ref.index])


def _torch():
    import torch
    return torch


_MAGIC = b"collectives.elastic shard 1\n"
_CHUNK = 1 << 22


def read(path: str):
    """The whole ``Commit`` of the complete checkpoint at ``path`` (any number of shards)."""
    from .state import Commit
    names = os.listdir(path)
    shards = sorted((int(m.group(1)), m.group(0)) for m in map(_SHARD.match, names) if m)
    parts = [load(os.path.join(path, name)) for _, name in shards]
    head = parts[0]
    model = {}
    state = {}
    for p in parts:
        model.update(p["model"])
        state.update(p["optimizer_state"])
    optimizer = None
    if head["optimizer_groups"] is not None:
        optimizer = {"state": dict(sorted(state.items())),
                     "param_groups": head["optimizer_groups"]}
    return Commit(head["next_step"], model if head["has_model"] else None, optimizer,
                  head["data"], head["extra"])


class Checkpointer:
    """Write every ``every``-th commit of a ``State`` to ``directory`` (see the module doc)."""

    def __init__(self, directory: str, every: int, comm=None, keep: int = 2):
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"every must be a positive integer, got {every!r}")
        from mpi4py import MPI
        self.directory, self.every, self.keep = directory, every, max(1, keep)
        self.comm = MPI.COMM_WORLD if comm is None else comm
        self.rank, self.size = self.comm.Get_rank(), self.comm.Get_size()
        self.last = -1                 # the newest next_step written or loaded
        self.written = 0               # checkpoints this rank wrote
        self.loop_seconds = 0.0        # time the training loop spent on them
        self.error = None
        self._queue: queue.Queue = queue.Queue(maxsize=1)
        self._idle = threading.Event()
        self._idle.set()
        self._thread = threading.Thread(target=self._write_loop, daemon=True,
                                        name="collectives-checkpoint")
        self._thread.start()
        os.makedirs(directory, exist_ok=True)

    def attach(self, state) -> None:
        """Write ``state``'s commits whose next step is a multiple of ``every``."""
        state.listeners.append(self.on_commit)

    def load_newest(self, state) -> int | None:
        """Load the newest complete checkpoint into ``state`` (nothing where there is none):
        its next step. Collective: rank 0 picks it, so that every rank loads the same."""
        found = None
        if self.rank == 0:
            found = newest(self.directory)
            self._drop_partial(found[0] if found else -1)
        found = self.comm.bcast(found, root=0)
        if found is None:
            return None
        state.load(read(found[1]))
        self.last = found[0]
        return found[0]

    def on_commit(self, commit) -> None:
        """A commit was made: queue it if it is due (the training loop's part of the cost)."""
        if commit.next_step % self.every or commit.next_step <= self.last:
            return
        t0 = time.perf_counter()
        if self.error is not None:
            raise RuntimeError(f"writing a checkpoint failed: {self.error}") from self.error
        self._idle.wait()              # one checkpoint in flight at most
        self._idle.clear()
        commit.readers += 1            # its tensors are not reused until it is written
        self._queue.put(commit)
        self.last = commit.next_step
        self.loop_seconds += time.perf_counter() - t0

    def mean_seconds(self) -> float:
        """The training loop's mean time per checkpoint written."""
        return self.loop_seconds / self.written if self.written else 0.0

    def close(self) -> None:
        """Wait for the checkpoint in flight; raise if a write failed."""
        self._idle.wait()
        if self.error is not None:
            raise RuntimeError(f"writing a checkpoint failed: {self.error}") from self.error

    def _write_loop(self) -> None:
        while True:
            commit = self._queue.get()
            try:
                self._write(commit)
                self.written += 1
            except Exception as exc:  # noqa: BLE001 - reported to the loop at the next commit
                self.error = exc
            finally:
                commit.readers -= 1
                self._idle.set()

    def _write(self, commit) -> None:
        path = os.path.join(self.directory, f"step-{commit.next_step:08d}")
        os.makedirs(path, exist_ok=True)
        name = f"shard-{self.rank}-of-{self.size}.pt"
        tmp = os.path.join(path, f".{name}.tmp")
        save(split(commit, self.rank, self.size), tmp)
        os.replace(tmp, os.path.join(path, name))
        with open(os.path.join(path, f"done-{self.rank}"), "w"):
            pass
        if self.rank == 0:
            self._prune()

    def _drop_partial(self, after: int) -> None:
        """Remove the checkpoints newer than ``after`` (incomplete ones: a job that died while
        writing them), so that this job's shards never mix with theirs."""
        for m in map(_STEP.match, os.listdir(self.directory)):
            if m and int(m.group(1)) > after:
                shutil.rmtree(os.path.join(self.directory, m.group(0)), ignore_errors=True)

    def _prune(self) -> None:
        names = sorted((int(m.group(1)), m.group(0))
                       for m in map(_STEP.match, os.listdir(self.directory)) if m)
        complete = [(s, n) for s, n in names if _complete(os.path.join(self.directory, n))]
        if len(complete) <= self.keep:
            return
        oldest_kept = complete[-self.keep][0]
        for s, n in names:
            if s < oldest_kept:
                shutil.rmtree(os.path.join(self.directory, n), ignore_errors=True)
