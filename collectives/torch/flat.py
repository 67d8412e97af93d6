"""One flat buffer for many tensors: the layout every torch-side caller packs tensors with.

A ``FlatBuffer`` lays tensors of one dtype and device end to end in one 1-D tensor (``flat``),
optionally padded to a multiple of ``pad_to`` elements (ZeRO's shards), and gives each tensor a
*view* into it, shaped like the tensor. One collective on ``flat`` then moves every tensor at
once. Its users:

- DDP's gradient buckets (``buckets.Bucket``): the views are the parameters' ``.grad``, so
  autograd accumulates straight into the buffer that is reduced;
- ZeRO's units (``sharded``): the views are the full parameters (stages 1 and 2) or, in
  stage 3, are bound to a fresh buffer at each gather and released after use; a second
  buffer of the same layout packs the gradients;
- the averagers' groups (``averaging``): parameters and buffers copied in, averaged, copied
  out;
- coalesced broadcasts (``agreement.broadcast_coalesced``): one rank's tensors in, every
  rank's out.

``copy_in`` / ``copy_out`` move every tensor in one ``torch._foreach_copy_`` (no Python loop
over elements); ``alias`` rebinds tensors' ``.data`` to the views.
"""
from __future__ import annotations

import torch

__all__ = ["FlatBuffer"]


class FlatBuffer:
    """Tensors of ``shapes`` laid end to end in one flat tensor of ``dtype`` on ``device``."""

    __slots__ = ("shapes", "offsets", "numel", "padded", "dtype", "device", "flat", "views")

    def __init__(self, shapes, dtype, device, *, pad_to: int = 1, alloc=None,
                 allocate: bool = True):
        self.shapes = [torch.Size(s) for s in shapes]
        self.dtype, self.device = dtype, torch.device(device)
        self.offsets, total = [], 0
        for s in self.shapes:
            self.offsets.append(total)
            total += s.numel()
        self.numel = total
        self.padded = -(-total // pad_to) * pad_to if total else 0
        self.flat = None
        self.views: list = []
        if allocate:
            self.allocate(alloc)

    @classmethod
    def of(cls, tensors, **kwargs) -> "FlatBuffer":
        """A buffer laid out for ``tensors`` (one dtype and device), not yet filled."""
        first = tensors[0]
        for t in tensors:
            if t.dtype != first.dtype or t.device != first.device:
                raise TypeError(f"a flat buffer holds one dtype and device: {first.dtype} on "
                                f"{first.device} and {t.dtype} on {t.device}")
        return cls([t.shape for t in tensors], first.dtype, first.device, **kwargs)

    def allocate(self, alloc=None) -> torch.Tensor:
        """Bind a new zeroed buffer (``alloc(numel, dtype, device)`` makes it, e.g. in a
        registered window; default ``torch.zeros``); returns it."""
        if alloc is None:
            flat = torch.zeros(self.padded, dtype=self.dtype, device=self.device)
        else:
            flat = alloc(self.padded, self.dtype, self.device)
        self.bind(flat)
        return flat

    def bind(self, flat) -> None:
        """Make ``flat`` (1-D, ``padded`` elements) the buffer and the views point into it."""
        if flat.dim() != 1 or flat.numel() != self.padded:
            raise ValueError(f"a flat buffer of {self.padded} elements is needed, got shape "
                             f"{tuple(flat.shape)}")
        self.flat = flat
        self.views = [flat[o:o + s.numel()].view(s) for o, s in zip(self.offsets, self.shapes)]

    def release(self) -> None:
        """Drop the buffer and the views (the memory goes once nothing else holds it)."""
        self.flat = None
        self.views = []

    def span(self, k: int) -> tuple[int, int]:
        """The element range of tensor ``k`` in ``flat``."""
        return self.offsets[k], self.offsets[k] + self.shapes[k].numel()

    def copy_in(self, tensors) -> None:
        """``tensors`` (in layout order) into their views."""
        torch._foreach_copy_(self.views, [t.detach() for t in tensors])

    def copy_out(self, tensors) -> None:
        """The views into ``tensors`` (in layout order)."""
        torch._foreach_copy_([t.detach() for t in tensors], self.views)

    def alias(self, tensors) -> None:
        """Rebind each of ``tensors``' ``.data`` to its view (the tensors live in ``flat``)."""
        for t, v in zip(tensors, self.views):
            t.data = v

    @property
    def nbytes(self) -> int:
        """The buffer's size in bytes (padding included)."""
        return self.padded * torch.empty(0, dtype=self.dtype).element_size()
