"""DDP communication hooks: ``hook(state, bucket) -> torch.futures.Future`` of the reduced bucket.

A hook receives a ``GradBucket`` (its flat ``buffer()``, ``gradients()`` as views into it,
``parameters()``, ``index()``, ``is_last()``) and returns a future whose value is a tensor of
the bucket's size holding the *averaged* gradients; DDP copies it into the bucket unless it is
the bucket's buffer already. Hooks are small and compose as wrappers, as in torch's
``default_hooks.py``:

    allreduce_hook                          allreduce with op="avg" (non-blocking)
    fp16_compress_hook = fp16_compress_wrapper(allreduce_hook)
    bf16_compress_hook = bf16_compress_wrapper(allreduce_hook)
    powerSGD_hook                           rank-r approximation with error feedback
    fp16_compress_wrapper(powerSGD_hook)    ... and its factors sent in float16

A wrapper casts the buffer to the low precision before the inner hook runs; the mean is the
core's ``op="avg"``, which scales the inputs before summing, so a float16 average of N
gradients cannot overflow where their mean would not. States are ``__slots__`` classes; every state
counts the bytes this rank hands to collectives (``wire_bytes``), so the savings of a
compressing hook are measured: a ring allreduce then moves ``2 (n-1)/n`` times that per rank.
"""
from __future__ import annotations

import functools

import torch

from .functional import all_reduce

__all__ = ["DefaultState", "PowerSGDState", "allreduce_hook", "fp16_compress_wrapper",
           "bf16_compress_wrapper", "fp16_compress_hook", "bf16_compress_hook",
           "powerSGD_hook", "noop_hook"]


def _comm_size(comm) -> int:
    if comm is None:
        from mpi4py import MPI
        comm = MPI.COMM_WORLD
    return comm.Get_size()


class DefaultState:
    """Where a hook communicates (``comm``, ``algorithm``) and what it has put on the wire."""

    __slots__ = ("comm", "algorithm", "size", "wire_bytes", "collectives")

    def __init__(self, comm=None, algorithm: str = "auto"):
        self.comm = comm
        self.algorithm = algorithm
        self.size = _comm_size(comm)
        self.wire_bytes = 0     # payload bytes handed to collectives by this rank
        self.collectives = 0    # how many collectives this state started

    def sent(self, tensor) -> None:
        """Count ``tensor`` as handed to one collective."""
        self.wire_bytes += tensor.numel() * tensor.element_size()
        self.collectives += 1

    def all_reduce(self, tensor, algorithm: str | None = None, op: str = "sum"):
        """Start an allreduce of ``tensor`` in place (``algorithm`` default the state's);
        returns the ``Work``."""
        self.sent(tensor)
        return all_reduce(tensor, op, comm=self.comm, async_op=True,
                          algorithm=algorithm or self.algorithm)


def _value(fut):
    return fut.value()[0]


def allreduce_hook(state: DefaultState, bucket):
    """Average the bucket over ranks: a non-blocking allreduce with ``op="avg"``."""
    return state.all_reduce(bucket.buffer(), op="avg").get_future().then(_value)


def noop_hook(state, bucket):
    """No communication: each rank keeps its local gradients (local SGD after the warm-up in
    ``collectives.torch.averaging``, which averages the parameters instead; else for
    measuring)."""
    fut = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


def _compress_wrapper(hook, dtype, label: str):
    @functools.wraps(hook)
    def compressed_hook(state, bucket):
        buf = bucket.buffer()
        bucket.set_buffer(buf.to(dtype))

        def decompress(fut):
            buf.copy_(fut.value().view(-1))
            return buf

        return hook(state, bucket).then(decompress)

    compressed_hook.__name__ = f"{label}_compress_{getattr(hook, '__name__', 'hook')}"
    compressed_hook.__qualname__ = compressed_hook.__name__
    compressed_hook.__doc__ = f"``{getattr(hook, '__name__', 'hook')}`` on a {label} copy " \
                              f"of the bucket."
    return compressed_hook


def fp16_compress_wrapper(hook):
    """``hook`` run on a float16 copy of the bucket (half the bytes), cast back after."""
    return _compress_wrapper(hook, torch.float16, "fp16")


def bf16_compress_wrapper(hook):
    """``hook`` run on a bfloat16 copy of the bucket (half the bytes), cast back after."""
    return _compress_wrapper(hook, torch.bfloat16, "bf16")


fp16_compress_hook = fp16_compress_wrapper(allreduce_hook)
fp16_compress_hook.__doc__ = "``fp16_compress_wrapper(allreduce_hook)``: average in float16."
bf16_compress_hook = bf16_compress_wrapper(allreduce_hook)
bf16_compress_hook.__doc__ = "``bf16_compress_wrapper(allreduce_hook)``: average in bfloat16."


# -- PowerSGD ------------------------------------------------------------------------------------
class PowerSGDState(DefaultState):
    """PowerSGD's settings and memory: error feedback and warm-started Q per bucket.

    ``matrix_approximation_rank`` r: each gradient matrix M (n x m, a parameter reshaped to
    ``(shape[0], -1)``) is sent as P (n x r) and Q (m x r) when that is at least
    ``min_compression_rate`` times smaller; vectors (biases) and small matrices are averaged
    uncompressed. Plain averaging runs for the first ``start_powerSGD_iter`` iterations.
    """

    __slots__ = ("matrix_approximation_rank", "start_powerSGD_iter", "min_compression_rate",
                 "use_error_feedback", "warm_start", "iter", "errors", "qs", "generator")

    def __init__(self, comm=None, algorithm: str = "auto", matrix_approximation_rank: int = 1,
                 start_powerSGD_iter: int = 10, min_compression_rate: float = 2.0,
                 use_error_feedback: bool = True, warm_start: bool = True,
                 random_seed: int = 0):
        super().__init__(comm, algorithm)
        if int(matrix_approximation_rank) < 1:
            raise ValueError(f"matrix_approximation_rank must be at least 1, got "
                             f"{matrix_approximation_rank}")
        if int(start_powerSGD_iter) < 0:
            raise ValueError(f"start_powerSGD_iter must be non-negative, got "
                             f"{start_powerSGD_iter}")
        self.matrix_approximation_rank = int(matrix_approximation_rank)
        self.start_powerSGD_iter = int(start_powerSGD_iter)
        self.min_compression_rate = float(min_compression_rate)
        self.use_error_feedback = bool(use_error_feedback)
        self.warm_start = bool(warm_start)
        self.iter = 0
        self.errors: dict = {}   # bucket index -> this rank's error (flat, like the bucket)
        self.qs: dict = {}       # bucket index -> Q memory (flat), kept for the warm start
        # The same seed on every rank: every rank draws the same initial Q.
        self.generator = torch.Generator().manual_seed(int(random_seed))

    def compresses(self, rows: int, cols: int) -> bool:
        """Whether an ``rows x cols`` matrix is sent as rank-r factors."""
        r = min(self.matrix_approximation_rank, rows, cols)
        return (rows + cols) * r * self.min_compression_rate < rows * cols

    def _count_iteration(self, bucket) -> None:
        if bucket.is_last():
            self.iter += 1


def _orthonormalize(p) -> None:
    """Replace the columns of ``p`` (n x r) by an orthonormal basis of their span, in place."""
    if p.shape[1] == 1:
        norm = torch.linalg.vector_norm(p)
        p.div_(norm if norm > 0 else 1.0)
    else:
        # QR in float32 at least: CPU has no half-precision QR, and it is r columns only.
        work = p if p.dtype in (torch.float32, torch.float64) else p.float()
        p.copy_(torch.linalg.qr(work, mode="reduced").Q)


def powerSGD_hook(state: PowerSGDState, bucket):
    """PowerSGD (Vogels et al. 2019): low-rank averaging with error feedback and warm start."""
    if state.iter < state.start_powerSGD_iter:
        state._count_iteration(bucket)
        return allreduce_hook(state, bucket)
    buf = bucket.buffer()
    index = bucket.index()

    # 1. Error feedback: compress (gradient + what earlier rounds left out), keep the input.
    if state.use_error_feedback:
        err = state.errors.get(index)
        if err is None or err.numel() != buf.numel() or err.dtype != buf.dtype:
            err = torch.zeros_like(buf)
            state.errors[index] = err
        buf.add_(err)
        err.copy_(buf)  # the input, until step 5 subtracts the approximation

    # 2. Split the bucket: matrices worth compressing go through P and Q, the rest is averaged.
    grads = bucket.gradients()
    matrices, vectors = [], []
    for g in grads:
        if g.dim() >= 2 and state.compresses(g.shape[0], g[0].numel()):
            matrices.append(g.reshape(g.shape[0], -1))
        else:
            vectors.append(g)
    rank = state.matrix_approximation_rank
    ranks = [min(rank, m.shape[0], m.shape[1]) for m in matrices]
    p_flat = buf.new_empty(sum(m.shape[0] * r for m, r in zip(matrices, ranks)))
    q_size = sum(m.shape[1] * r for m, r in zip(matrices, ranks))
    q_flat = state.qs.get(index)
    fresh = q_flat is None or q_flat.numel() != q_size or q_flat.dtype != buf.dtype
    if fresh or not state.warm_start:
        q_flat = torch.randn(q_size, generator=state.generator).to(buf.dtype)
        state.qs[index] = q_flat
    ps, qs = [], []
    po = qo = 0
    for m, r in zip(matrices, ranks):
        ps.append(p_flat[po:po + m.shape[0] * r].view(m.shape[0], r))
        qs.append(q_flat[qo:qo + m.shape[1] * r].view(m.shape[1], r))
        po += m.shape[0] * r
        qo += m.shape[1] * r
    if fresh or not state.warm_start:
        for q in qs:
            _orthonormalize(q)

    # 3. Start the averaging of the vectors (``op="avg"``) and the sum of P = M Q divided by
    #    the rank count (P's scale is lost to step 4's orthonormalization anyway, and a
    #    low-precision sum stays in range).
    if vectors:
        flat_vectors = torch.cat([v.reshape(-1) for v in vectors])
        vectors_work = state.all_reduce(flat_vectors, op="avg")
    for m, q, p in zip(matrices, qs, ps):
        torch.matmul(m, q, out=p)
    p_work = state.all_reduce(p_flat.div_(state.size)) if matrices else None

    # 4. When P is averaged: orthonormalize it, Q = M^T P / n, and start Q's sum.
    def compute_q(_):
        for m, q, p in zip(matrices, qs, ps):
            _orthonormalize(p)
            torch.matmul(m.t(), p, out=q)
        return state.all_reduce(q_flat.div_(state.size))

    # 5. When Q is averaged: M ~ P Q^T into the bucket; the error is input - approximation.
    def decompress(fut):
        if matrices:
            fut.value().wait()
            for m, q, p in zip(matrices, qs, ps):
                torch.matmul(p, q.t(), out=m)
        if vectors:
            vectors_work.wait()
            offset = 0
            for v in vectors:
                v.copy_(flat_vectors[offset:offset + v.numel()].view(v.shape))
                offset += v.numel()
        if state.use_error_feedback:
            state.errors[index].sub_(buf)
        return buf

    state._count_iteration(bucket)
    if p_work is not None:
        return p_work.get_future().then(compute_q).then(decompress)
    if vectors:
        return vectors_work.get_future().then(decompress)
    fut = torch.futures.Future()
    fut.set_result(buf)
    return fut
