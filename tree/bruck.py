"""Bruck's all-to-all: ceil(log2 p) messages per rank instead of p - 1, for small blocks.

Vocabulary: every rank sends a *block* of ``b`` elements to every rank (equal blocks: Bruck
moves blocks between ranks that do not own them, so every rank must know every block's size).
TMP holds p *slots*; slot i of rank r holds, at the end, the block that rank r - i sent to r.

1. Rotate: slot i = IN block (r + i) mod p, the block destined i ranks ahead.
2. Step k = 0 .. ceil(log2 p) - 1, distance d = 2^k: the slots whose index has bit k set are
   packed into one message for rank r + d; the message from rank r - d is unpacked into the
   same slot indices. A block in slot i travels i ranks ahead in total, bit by bit.
3. Unrotate: OUT block (r - i) mod p = slot i.

Walk-through for p = 4, rank 0: slots = IN blocks 0, 1, 2, 3. Step 0 (d = 1) sends slots 1
and 3 to rank 1 and receives rank 3's slots 1 and 3; step 1 (d = 2) sends slots 2 and 3 to
rank 2 and receives rank 2's. Two messages of 2 blocks each, against pairwise's three of one:
fewer, larger messages win while a block is small against the per-message cost (latency), and
lose once moving each block log2(p)/2 times costs more than the messages saved.
"""
from collectives.schedule import IN, OUT, TMP, Schedule, segments

__all__ = ["bruck_alltoall"]


def bruck_alltoall(rank: int, size: int, send, recv, *, seg=None, matrix=None) -> Schedule:
    """Bruck all-to-all of equal blocks: ``send`` and ``recv`` are ``size`` equal counts."""
    b = send[0] if size else 0
    if any(c != b for c in send) or any(c != b for c in recv):
        raise ValueError("bruck all-to-all needs equal blocks (every rank sends as many "
                         "elements to every rank); use pairwise for ragged counts")
    p, r = size, rank
    s = Schedule(r, p, p * b, p * b, name="tree.bruck_alltoall")
    s.alias = False
    slots = s.scratch(p * b)
    most = (p + 1) // 2  # slots with a given bit set, at most
    pack, unpack = s.scratch(most * b), s.scratch(most * b)

    def slot(i):
        return (TMP, slots + i * b, slots + (i + 1) * b)

    for i in range(p):
        src = (r + i) % p
        s.copy(slot(i), (IN, src * b, (src + 1) * b))
    d = 1
    while d < p:
        moving = [i for i in range(p) if i & d]
        n = len(moving) * b
        for j, i in enumerate(moving):
            s.copy((TMP, pack + j * b, pack + (j + 1) * b), slot(i))
        for a, z in segments(0, n, seg):
            s.send((r + d) % p, (TMP, pack + a, pack + z))
        for a, z in segments(0, n, seg):
            s.recv((r - d) % p, (TMP, unpack + a, unpack + z))
        for j, i in enumerate(moving):
            s.copy(slot(i), (TMP, unpack + j * b, unpack + (j + 1) * b))
        d *= 2
    for i in range(p):
        dst = (r - i) % p
        s.copy((OUT, dst * b, (dst + 1) * b), slot(i))
    return s
