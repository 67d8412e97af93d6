"""Folding a size that is not a power of two onto the largest power of two below it.

Butterfly algorithms (recursive doubling and halving, Rabenseifner) pair rank v with v XOR 2^k,
which needs a power-of-two number of ranks. With p = p' + rem ranks (p' the largest power of
two not above p), the first 2 rem ranks pair up before the butterfly: in each pair (2i, 2i+1)
the even rank hands its data to the odd one and sits out, and the odd one stands for both
(virtual rank i). The other ranks r >= 2 rem are virtual rank r - rem. After the butterfly the
odd rank hands the result back (unfold). Walk-through for p = 6 (p' = 4, rem = 2): pairs (0, 1)
and (2, 3); virtual ranks 0..3 are real ranks 1, 3, 4, 5; ranks 0 and 2 wait for the result.

Virtual rank v stands for a contiguous run of real ranks (``first(v)`` to ``first(v + 1) - 1``),
so per-rank blocks of a reduce-scatter or all-gather stay contiguous per virtual rank. The
pairing costs two extra messages of latency and, for whole-buffer collectives, 2 n of extra
traffic on the paired ranks (MPICH's choice too: simple, and rare at scale where p is a power
of two).
"""
from collectives.schedule import IN, OUT, segments

__all__ = ["Fold", "begin_allreduce"]


class Fold:
    """The fold of ``size`` ranks onto ``pp`` (a power of two) virtual ranks (module doc)."""

    __slots__ = ("size", "pp", "rem", "steps")

    def __init__(self, size: int):
        self.size = size
        self.pp = 1 << (size.bit_length() - 1)
        self.rem = size - self.pp
        self.steps = self.pp.bit_length() - 1

    def vrank(self, rank: int):
        """The virtual rank of ``rank``, or None for a rank that sits the butterfly out."""
        if rank < 2 * self.rem:
            return rank // 2 if rank % 2 else None
        return rank - self.rem

    def real(self, v: int) -> int:
        """The real rank that plays virtual rank ``v``."""
        return 2 * v + 1 if v < self.rem else v + self.rem

    def first(self, v: int) -> int:
        """The lowest real rank that virtual rank ``v`` stands for (``first(pp) == size``)."""
        return 2 * v if v < self.rem else v + self.rem

    def paired(self, rank: int) -> bool:
        """Whether ``rank`` is in a pair (it either sits out or stands for two ranks)."""
        return rank < 2 * self.rem

    def sit_out(self, s, rank: int, pieces) -> bool:
        """For a rank that sits the butterfly out, append its whole part to ``s`` (hand the
        input to its partner, get the result back, segment by segment) and return True."""
        if self.vrank(rank) is not None:
            return False
        for a, b in pieces:
            s.send(rank + 1, (IN, a, b))
        for a, b in pieces:
            s.recv(rank + 1, (OUT, a, b))
        return True


def begin_allreduce(s, count: int, seg):
    """The start every butterfly allreduce shares: on one rank OUT = IN; a rank that sits the
    butterfly out appends its whole part (``Fold.sit_out``); both leave ``s`` complete and
    return None. Otherwise ``(fold, v, pieces)``: the fold of ``s.size`` ranks, this rank's
    virtual rank and the buffer's segments."""
    if s.size == 1:
        s.copy((OUT, 0, count), (IN, 0, count))
        return None
    fold = Fold(s.size)
    pieces = list(segments(0, count, seg))
    if fold.sit_out(s, s.rank, pieces):  # hand the input over, get the result back
        return None
    return fold, fold.vrank(s.rank), pieces
