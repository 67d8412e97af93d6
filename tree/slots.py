"""Receive slots: a ring of segment-sized scratch areas that incoming messages land in.

A message that is to be reduced cannot land in OUT (OUT holds this rank's own partial), so it
lands in a *slot* of TMP and is reduced from there. Slots are reused round-robin; the schedule's
derived dependencies make the receive into a reused slot wait until the reduction that read the
slot's previous message has run. With several slots, the receives of the next segments are
posted while the current one is being reduced, which is what lets segments pipeline; with one
message per round (no segmentation) a couple of slots suffice and keep scratch at O(count).
"""
from collectives.schedule import TMP, Schedule

__all__ = ["Slots", "SLOTS"]

SLOTS = 4


class Slots:
    """A ring of receive slots in TMP, sized for messages of at most ``largest`` elements cut
    into segments of ``seg``; ``per_round`` receives are expected per segment round."""

    __slots__ = ("base", "size", "n", "k")

    def __init__(self, s: Schedule, largest: int, seg=None, per_round: int = 1):
        segmented = bool(seg) and 0 < seg < largest
        self.size = min(largest, seg) if segmented else largest
        self.n = max(SLOTS, 2 * per_round) if segmented else max(1, per_round)
        self.base = s.scratch(self.n * self.size)
        self.k = 0

    def take(self, length: int):
        """The TMP region of the next slot, ``length`` (at most the slot size) elements long."""
        assert 0 <= length <= self.size, (length, self.size)
        start = self.base + (self.k % self.n) * self.size
        self.k += 1
        return (TMP, start, start + length)
