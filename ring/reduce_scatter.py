"""Ring reduce-scatter.

Vocabulary: the flat buffer is cut into p *blocks* (block k, ``counts[k]`` elements, ends up
reduced on rank k); each block travels as *segments* of at most ``seg`` elements; a *step* is one
hop of every block around the ring (p - 1 steps in all). Rank r sends to r + 1 and receives from
r - 1 (mod p).

At step s, rank r sends its partial sum of block (r - s - 1) and receives the partial sum of
block (r - s - 2) from its left neighbour, which it reduces with its own input. At step 0 the
partial it sends is just its input. Walk-through for p = 4, rank 0:

    step 0: send IN[3]                      recv block 2, acc[2] = IN[2] op recv
    step 1: send acc[2]                     recv block 1, acc[1] = IN[1] op recv
    step 2: send acc[1]                     recv block 0, OUT    = IN[0] op recv   (done)

Block k is thus reduced in the fixed order k+1, k+2, ..., k along the ring: one rank computes
each element's result, so an all-gather after it gives bitwise-identical results everywhere.

Received segments land in a ring of ``SLOTS`` segment-sized scratch slots, so up to ``SLOTS``
receives are posted ahead while earlier segments are being reduced. Partial sums live in
``acc``: OUT itself in allreduce (same layout as IN), else two step-parity areas of scratch.
"""
from collectives.schedule import IN, OUT, TMP, Schedule, offsets, segments

__all__ = ["reduce_scatter", "append_reduce_scatter", "SLOTS"]

SLOTS = 4


def append_reduce_scatter(s: Schedule, bounds, seg, *, acc_in_out: bool) -> None:
    """Append the ring reduce-scatter of blocks ``bounds`` (p + 1 offsets into IN) to ``s``.

    ``acc_in_out``: partials and the result go to OUT at the block's own offsets (allreduce);
    otherwise partials go to scratch and rank r's result to ``OUT[0:counts[r]]``.
    """
    r, p = s.rank, s.size
    right, left = (r + 1) % p, (r - 1) % p
    biggest = max(bounds[k + 1] - bounds[k] for k in range(p))
    slot = min(biggest, seg) if seg else biggest
    slots = s.scratch(SLOTS * slot)
    acc = None if acc_in_out else [s.scratch(biggest), s.scratch(biggest)]

    def partial(k, step):  # where rank r keeps its partial sum of block k after `step`
        if acc_in_out:
            return OUT, bounds[k]
        if step == p - 2:
            return OUT, 0
        return TMP, acc[step % 2]

    piece = 0
    for step in range(p - 1):
        send_k, recv_k = (r - step - 1) % p, (r - step - 2) % p
        if step == 0:
            send_buf, send_at = IN, bounds[send_k]
        else:
            send_buf, send_at = partial(send_k, step - 1)
        send_n = bounds[send_k + 1] - bounds[send_k]
        recv_n = bounds[recv_k + 1] - bounds[recv_k]
        acc_buf, acc_at = partial(recv_k, step)
        sends = list(segments(0, send_n, seg))
        recvs = list(segments(0, recv_n, seg))
        for j in range(max(len(sends), len(recvs))):
            if j < len(sends):
                a, b = sends[j]
                s.send(right, (send_buf, send_at + a, send_at + b))
            if j < len(recvs):
                a, b = recvs[j]
                t = slots + (piece % SLOTS) * slot
                piece += 1
                s.recv(left, (TMP, t, t + b - a))
                s.reduce((acc_buf, acc_at + a, acc_at + b),
                         (IN, bounds[recv_k] + a, bounds[recv_k] + b), (TMP, t, t + b - a))


def reduce_scatter(rank: int, size: int, counts, *, seg=None) -> Schedule:
    """Ring reduce-scatter: IN has ``sum(counts)`` elements, OUT rank's ``counts[rank]``."""
    bounds = offsets(counts)
    s = Schedule(rank, size, bounds[-1], counts[rank], name="ring.reduce_scatter")
    s.alias = False
    if size == 1:
        s.copy((OUT, 0, bounds[-1]), (IN, 0, bounds[-1]))
        return s
    append_reduce_scatter(s, bounds, seg, acc_in_out=False)
    return s


