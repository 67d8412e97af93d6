"""Error types raised by the toolkit."""
from __future__ import annotations

__all__ = ["CollectiveError", "MismatchError", "MessageSizeError", "CollectiveTimeout"]


class CollectiveError(RuntimeError):
    """A collective failed while running (after argument checks passed)."""


class MismatchError(CollectiveError, ValueError):
    """Ranks called a collective with arguments that do not agree (raised on every rank)."""


class MessageSizeError(CollectiveError):
    """A received message did not have the size the schedule expected."""


class CollectiveTimeout(CollectiveError):
    """A collective did not complete within ``COLLECTIVES_TIMEOUT`` seconds."""
