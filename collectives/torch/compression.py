"""Gradient compression with error feedback as DDP comm hooks: top-k, sign (1-bit), QSGD.

    state = TopKState(ratio=0.01)                 # or SignState(), QSGDState(bits=4)
    model = DistributedDataParallel(module, comm_hook=(state, topk_hook))

Each hook sends every rank's compressed bucket through one ``collectives.iallgather`` of
bytes (a sum of compressed gradients is not compressed, so these formats are gathered, not
reduced) and decompresses the n contributions into their average:

* ``topk_hook``: the k = ceil(ratio x elements) entries largest in magnitude, as int32 indices
  and values in the bucket's dtype (4 + itemsize bytes each); 2/ratio x fewer bytes in fp32.
* ``sign_hook``: EF-signSGD / 1-bit SGD (Karimireddy et al. 2019): one bit per element, packed,
  and one float32 scale (the mean magnitude) per chunk; about 30x fewer bytes.
* ``qsgd_hook``: QSGD (Alistarh et al. 2017): the L2 norm of each chunk, and per element a
  sign and a level in 0..2^bits-1 drawn by stochastic rounding, one int8 each (bits <= 7);
  about 4x fewer bytes.

A *chunk* is at most ``CHUNK`` elements of one parameter (never two: a bias whose entries are
large next to its weight's gets a scale of its own), so a scale or norm does not drown the
small entries it shares a chunk with.

*Momentum* (``momentum=beta``, default 0): the hook keeps this rank's momentum
m = beta m + g per bucket and compresses m instead of g; the optimizer then runs without
momentum. Compressing the momentum-updated step rather than the gradient is what
momentum correction (Lin et al. 2018, Deep Gradient Compression) and blockwise
EF-SGD with momentum (Zheng et al. 2019) do: the average that comes back is the step itself,
and what compression leaves out is not amplified a second time by an optimizer's momentum.

*Error feedback* (``error_feedback=True``, the default): the hook compresses the gradient (or
the momentum) plus what earlier rounds left out (the *residual*, one per bucket and rank) and
keeps the new residual = input - what was sent, so nothing is lost, only delayed. A rank that
joined (``DistributedDataParallel.join``) sends zeros and keeps its residual and momentum out
of them. Every state counts the bytes it hands to collectives (``wire_bytes``); the layout of
a payload (each part starts on 8 bytes) is fixed by the sizes of the bucket's parameters, so
every rank sends the same byte count.
The numpy bit packing makes ``sign_hook`` a CPU hook.
"""
from __future__ import annotations

import math

import numpy as np
import torch

import collectives as coll

from .functional import Work
from .hooks import DefaultState

__all__ = ["CHUNK", "CompressionState", "TopKState", "SignState", "QSGDState", "topk_hook",
           "sign_hook", "qsgd_hook"]


def _up8(nbytes: int) -> int:
    return (nbytes + 7) // 8 * 8


def _done(tensor):
    fut = torch.futures.Future()
    fut.set_result(tensor)
    return fut


class CompressionState(DefaultState):
    """What a compressing hook keeps: error feedback's residuals and the byte buffers."""

    __slots__ = ("error_feedback", "momentum", "residuals", "momenta", "scratch")

    def __init__(self, comm=None, algorithm: str = "auto", error_feedback: bool = True,
                 momentum: float = 0.0):
        super().__init__(comm, algorithm)
        if isinstance(momentum, bool) or not 0 <= float(momentum) < 1:
            raise ValueError(f"momentum must be in [0, 1), got {momentum!r}")
        self.error_feedback = bool(error_feedback)
        self.momentum = float(momentum)
        self.residuals: dict = {}   # bucket index -> this rank's residual (flat, like the bucket)
        self.momenta: dict = {}     # bucket index -> this rank's momentum (flat, like the bucket)
        self.scratch: dict = {}     # bucket index -> (payload, gathered) byte tensors

    def feedback(self, bucket):
        """Turn the bucket's gradient into what is compressed: with ``momentum``, this rank's
        momentum m = momentum x m + g; with error feedback, plus the residual. Returns the
        residual to update, or None."""
        if bucket.joined():
            return None
        buf = bucket.buffer()
        index = bucket.index()
        if self.momentum:
            mom = self.momenta.get(index)
            if mom is None or mom.numel() != buf.numel() or mom.dtype != buf.dtype:
                mom = self.momenta[index] = torch.zeros_like(buf)
            buf.copy_(mom.mul_(self.momentum).add_(buf))
        if not self.error_feedback:
            return None
        res = self.residuals.get(index)
        if res is None or res.numel() != buf.numel() or res.dtype != buf.dtype:
            res = self.residuals[index] = torch.zeros_like(buf)
        buf.add_(res)
        return res

    def buffers(self, bucket, nbytes: int):
        """This rank's payload (``nbytes``) and the gathered payloads of every rank."""
        pair = self.scratch.get(bucket.index())
        if pair is None or pair[0].numel() != nbytes:
            pair = (torch.empty(nbytes, dtype=torch.uint8),
                    torch.empty(self.size * nbytes, dtype=torch.uint8))
            self.scratch[bucket.index()] = pair
        return pair

    def all_gather(self, payload, gathered):
        """Start the allgather of ``payload`` into ``gathered``; returns its future."""
        self.sent(payload)
        req = coll.iallgather(payload, out=gathered, comm=self.comm, algorithm=self.algorithm)
        return Work(req, [gathered]).get_future()


class TopKState(CompressionState):
    """``topk_hook``'s settings: the fraction of each bucket's entries sent (0 < ratio <= 1)."""

    __slots__ = ("ratio",)

    def __init__(self, comm=None, algorithm: str = "auto", ratio: float = 0.01,
                 error_feedback: bool = True, momentum: float = 0.0):
        super().__init__(comm, algorithm, error_feedback, momentum)
        if not 0 < float(ratio) <= 1:
            raise ValueError(f"ratio must be in (0, 1], got {ratio!r}")
        self.ratio = float(ratio)


class SignState(CompressionState):
    """``sign_hook``'s state (error feedback on by default, as EF-signSGD needs)."""

    __slots__ = ()


class QSGDState(CompressionState):
    """``qsgd_hook``'s settings: ``bits`` (1..7) per level, a per-rank random stream."""

    __slots__ = ("bits", "generator")

    def __init__(self, comm=None, algorithm: str = "auto", bits: int = 4,
                 error_feedback: bool = True, momentum: float = 0.0, random_seed: int = 0):
        super().__init__(comm, algorithm, error_feedback, momentum)
        if isinstance(bits, bool) or int(bits) != bits or not 1 <= int(bits) <= 7:
            raise ValueError(f"bits must be an integer from 1 to 7 (int8 levels), got {bits!r}")
        self.bits = int(bits)
        rank = 0 if self.size == 1 else (self.comm.Get_rank() if self.comm is not None else
                                         _world_rank())
        # Different draws on every rank: the rounding errors of the ranks are independent.
        self.generator = torch.Generator().manual_seed(int(random_seed) * 7919 + rank)


def _world_rank() -> int:
    from mpi4py import MPI
    return MPI.COMM_WORLD.Get_rank()


CHUNK = 512  # elements per scale or norm (QSGD's "bucket size"), as in the papers


def _chunks(bucket):
    """The sizes of the pieces of ``bucket`` that get one scale or norm each: every parameter
    split into ``CHUNK``-element pieces (its last one may be short). A piece never spans two
    parameters: a bias whose gradient is large next to its weight's entries gets a scale of
    its own, instead of a residual that error feedback lets grow and releases in bursts."""
    numels = torch.tensor([p.numel() for p in bucket.parameters()], dtype=torch.int64)
    numels = numels[numels > 0]
    pieces = (numels + CHUNK - 1) // CHUNK
    sizes = torch.full((int(pieces.sum()),), CHUNK, dtype=torch.int64)
    sizes[torch.cumsum(pieces, 0) - 1] = numels - CHUNK * (pieces - 1)
    return sizes


def _chunk_sums(values, sizes):
    """The float64 sum of ``values`` over each chunk of ``sizes``."""
    sums = torch.zeros(sizes.numel(), dtype=torch.float64)
    sums.index_add_(0, torch.repeat_interleave(torch.arange(sizes.numel()), sizes),
                    values.to(torch.float64))
    return sums


def _every_rank_scales(rows, sizes, dtype):
    """Each rank's float32 per-chunk scales (the head of its gathered row), spread over the
    chunks' elements: an ``(n, numel)`` tensor of ``dtype``."""
    n, nchunks = rows.shape[0], sizes.numel()
    scales = rows[:, :4 * nchunks].reshape(-1).view(torch.float32).view(n, nchunks)
    return torch.repeat_interleave(scales.to(dtype), sizes, dim=1)


def topk_hook(state: TopKState, bucket):
    """Send the largest ``ratio`` of the bucket's entries (indices and values); average them."""
    buf = bucket.buffer()
    numel, n = buf.numel(), state.size
    if numel == 0:
        return _done(buf)
    res = state.feedback(bucket)
    k = min(numel, max(1, math.ceil(state.ratio * numel)))
    isz = buf.element_size()
    head = _up8(4 * k)
    payload, gathered = state.buffers(bucket, head + _up8(k * isz))
    idx = payload[:4 * k].view(torch.int32)
    vals = payload[head:head + k * isz].view(buf.dtype)
    # 1. The k largest magnitudes, and what they leave behind for the next round.
    top = torch.topk(buf.abs(), k, sorted=False).indices
    idx.copy_(top)
    torch.index_select(buf, 0, top, out=vals)
    if res is not None:
        res.copy_(buf)
        res.index_fill_(0, top, 0)

    # 2. Every rank's entries, summed where indices meet, divided by the rank count.
    def decompress(fut):
        rows = fut.value()[0].view(n, -1)
        every_idx = rows[:, :4 * k].reshape(-1).view(torch.int32)
        every_val = rows[:, head:head + k * isz].reshape(-1).view(buf.dtype)
        buf.zero_()
        buf.index_add_(0, every_idx, every_val)
        return buf.div_(n)

    return state.all_gather(payload, gathered).then(decompress)


def _chunked_payload(state, bucket, body: int):
    """The bucket made ready to compress (``feedback``) and the payload of the hooks that send
    one float32 per chunk (``_chunks``) then ``body`` bytes: (residual or None, chunk sizes,
    the header's bytes, this rank's payload, every rank's, the header's floats)."""
    res = state.feedback(bucket)
    sizes = _chunks(bucket)
    head = _up8(4 * sizes.numel())
    payload, gathered = state.buffers(bucket, head + _up8(body))
    return res, sizes, head, payload, gathered, payload[:4 * sizes.numel()].view(torch.float32)


def sign_hook(state: SignState, bucket):
    """1-bit: the signs, packed, and each chunk's mean magnitude; average the n of them."""
    buf = bucket.buffer()
    numel, n = buf.numel(), state.size
    if numel == 0:
        return _done(buf)
    nb = (numel + 7) // 8
    res, sizes, head, payload, gathered, scales = _chunked_payload(state, bucket, nb)
    # 1. Per chunk: scale = mean |g| (the L1 norm over the count keeps the step's size).
    scales.copy_(_chunk_sums(buf.abs(), sizes) / sizes)
    positive = buf >= 0
    payload.numpy()[head:head + nb] = np.packbits(positive.numpy(), bitorder="little")
    if res is not None:
        # The residual: input - scale x sign.
        sent = torch.repeat_interleave(scales.to(buf.dtype), sizes)
        sent.mul_(positive.to(buf.dtype).mul_(2).sub_(1))
        torch.sub(buf, sent, out=res)

    # 2. Average: sum over ranks of scale_r x sign_r, over n.
    def decompress(fut):
        rows = fut.value()[0].view(n, -1)
        bits = np.unpackbits(rows[:, head:head + nb].numpy(), axis=1, count=numel,
                             bitorder="little")
        signs = torch.from_numpy(bits).to(buf.dtype).mul_(2).sub_(1)
        signs.mul_(_every_rank_scales(rows, sizes, buf.dtype))
        torch.sum(signs, 0, out=buf)
        return buf.div_(n)

    return state.all_gather(payload, gathered).then(decompress)


def qsgd_hook(state: QSGDState, bucket):
    """QSGD: per chunk its norm, per element a stochastically rounded level; average."""
    buf = bucket.buffer()
    numel, n = buf.numel(), state.size
    if numel == 0:
        return _done(buf)
    levels = (1 << state.bits) - 1
    res, sizes, head, payload, gathered, norms = _chunked_payload(state, bucket, numel)
    owner = torch.repeat_interleave(torch.arange(sizes.numel()), sizes)
    # 1. Norms, then |g| / norm x levels rounded up with probability of its fraction.
    norms.copy_(_chunk_sums(buf.to(torch.float64).square(), sizes).sqrt_())
    per = norms[owner].to(buf.dtype)
    scaled = buf.abs().div_(torch.where(per > 0, per, torch.ones_like(per))).mul_(levels)
    scaled.add_(torch.rand(numel, generator=state.generator, dtype=scaled.dtype)).floor_()
    q = scaled.clamp_(max=levels).mul_(torch.sign(buf))
    payload[head:head + numel].view(torch.int8).copy_(q)
    if res is not None:
        torch.sub(buf, q.mul_(per).div_(levels), out=res)

    # 2. Average: sum over ranks of norm_r x level_r / levels, over n.
    def decompress(fut):
        rows = fut.value()[0].view(n, -1)
        vals = rows[:, head:head + numel].view(torch.int8).to(buf.dtype)
        vals.mul_(_every_rank_scales(rows, sizes, buf.dtype))
        torch.sum(vals, 0, out=buf)
        return buf.div_(n * levels)

    return state.all_gather(payload, gathered).then(decompress)
