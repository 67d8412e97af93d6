"""Gradient buckets: which parameters share one flat buffer, and the buffers themselves.

DDP reduces gradients bucket by bucket so that the communication of the gradients computed
first overlaps with the backward computation of the rest. ``assign`` decides the buckets the
way torch's Reducer does: parameters are taken in an *order* -- at first the reverse of
``module.parameters()`` (backward produces gradients roughly last layer first), later the order
in which gradients actually became ready -- and packed greedily into one open bucket per
(dtype, device); a bucket closes once it holds at least its size limit. The first bucket of
each kind has a small limit (``FIRST_BUCKET_BYTES``) so that the first allreduce starts as soon
as possible; the others close at ``cap_bytes``. Buckets are numbered by the position of their
first parameter in the order, which is the order they become ready and are launched in.

A ``Bucket`` is a ``FlatBuffer`` (``collectives.torch.flat``): one flat tensor, and for each of
its parameters a *view* into it (shaped like the parameter), which DDP installs as
``param.grad`` (``gradient_as_bucket_view``) so that autograd accumulates straight into the
buffer that goes on the wire. ``GradBucket`` is what a comm hook sees (the method names of
``torch.distributed.GradBucket``).
"""
from __future__ import annotations

from .flat import FlatBuffer

__all__ = ["FIRST_BUCKET_BYTES", "assign", "Bucket", "GradBucket"]

FIRST_BUCKET_BYTES = 1 << 20  # torch's dist._DEFAULT_FIRST_BUCKET_BYTES


def assign(nbytes, keys, cap_bytes: int, order=None,
           first_bytes: int = FIRST_BUCKET_BYTES) -> list[list[int]]:
    """Parameter indices grouped into buckets (see the module doc).

    ``nbytes[i]``/``keys[i]`` are parameter i's size in bytes and its grouping key (dtype and
    device); ``order`` lists every index once (default: reverse index order).
    """
    n = len(nbytes)
    if len(keys) != n:
        raise ValueError(f"{n} sizes but {len(keys)} keys")
    order = list(range(n - 1, -1, -1)) if order is None else [int(i) for i in order]
    if sorted(order) != list(range(n)):
        raise ValueError(f"order must list each of the {n} parameter indices once")
    if cap_bytes <= 0:
        raise ValueError(f"bucket cap must be positive, got {cap_bytes} bytes")
    limits = (min(first_bytes, cap_bytes), cap_bytes)
    open_: dict = {}      # key -> [indices, bytes]
    closed_count: dict = {}
    buckets: list[list[int]] = []
    for i in order:
        entry = open_.setdefault(keys[i], [[], 0])
        entry[0].append(i)
        entry[1] += int(nbytes[i])
        limit = limits[min(closed_count.get(keys[i], 0), 1)]
        if entry[1] >= limit:
            buckets.append(entry[0])
            closed_count[keys[i]] = closed_count.get(keys[i], 0) + 1
            del open_[keys[i]]
    buckets.extend(entry[0] for entry in open_.values() if entry[0])
    position = {i: k for k, i in enumerate(order)}
    buckets.sort(key=lambda b: position[b[0]])
    return buckets


class Bucket(FlatBuffer):
    """One flat gradient buffer and the views of its parameters' gradients into it."""

    __slots__ = ("index", "members")

    def __init__(self, index: int, members, params, alloc=None):
        self.index = index
        self.members = list(members)  # parameter indices, in bucket order
        # ``alloc(numel, dtype, device)``: a zeroed flat tensor (DDP's registered buffers)
        first = params[self.members[0]]
        super().__init__([params[i].shape for i in self.members], first.dtype, first.device,
                         alloc=alloc)


class GradBucket:
    """What a comm hook receives: one bucket's flat gradient buffer and its parameters."""

    __slots__ = ("_index", "_buffer", "_params", "_last", "_joined")

    def __init__(self, index: int, buffer, params, last: bool, joined: bool = False):
        self._index = index
        self._buffer = buffer
        self._params = params
        self._last = last
        self._joined = joined

    def joined(self) -> bool:
        """True when a rank that ran out of data stands in with zeros (``DDP.join``): hooks
        keep their error-feedback memory out of it."""
        return self._joined

    def index(self) -> int:
        """The bucket's position in launch order (0 is launched first)."""
        return self._index

    def buffer(self):
        """The flat gradient tensor to reduce (may be replaced with ``set_buffer``)."""
        return self._buffer

    def set_buffer(self, tensor) -> None:
        """Replace the buffer that inner hooks see (compression wrappers do this)."""
        if tensor.numel() != self._buffer.numel():
            raise ValueError(f"bucket {self._index}: the new buffer has {tensor.numel()} "
                             f"elements, the bucket {self._buffer.numel()}")
        self._buffer = tensor

    def gradients(self) -> list:
        """Each parameter's gradient as a view into the current buffer, shaped like it."""
        views, offset = [], 0
        for p in self._params:
            views.append(self._buffer[offset:offset + p.numel()].view(p.shape))
            offset += p.numel()
        return views

    def parameters(self) -> list:
        """The bucket's parameters, in the buffer's order."""
        return list(self._params)

    def is_last(self) -> bool:
        """True for the last bucket of the iteration (hooks count iterations on it)."""
        return self._last

    def __repr__(self):
        return (f"<GradBucket {self._index} {self._buffer.numel()} x {self._buffer.dtype}"
                f"{' last' if self._last else ''}>")
