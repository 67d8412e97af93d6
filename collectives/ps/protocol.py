"""The parameter server's wire format: op codes, tags, header layouts and status codes.

Messages are ``collectives.p2p``'s: buffer-based, a dtype is its wire code (``p2p.code_of``),
and every wait is p2p's watched one. A request from a worker to a server is one fixed-size
int64 header on ``TAG_REQUEST``,
followed, when the op carries data, by its keys (int64) on ``TAG_KEYS`` and its values on
``TAG_VALUES``. MPI's non-overtaking rule (messages from one sender on one tag match in the
order they were sent) pairs a header with its payload, since a server receives a request's
payload right after its header. A reply is a fixed-size int64 header and, for pulls and
lookups, one data message, both on the two tags the request's id selects (``reply_tags``), so
any number of requests per worker may be outstanding and replies may complete in any order.
"""
from __future__ import annotations

import numpy as np

from ..p2p import code_of

__all__ = ["HEADER", "REPLY", "TAG_REQUEST", "TAG_KEYS", "TAG_VALUES", "reply_tags",
           "WINDOW", "FLAG_WHOLE", "Op", "Status", "TABLE_DTYPES", "dtype_code"]

HEADER = 8   # int64 words: op, table, request id, count, clock, flags, dtype code, spare
REPLY = 4    # int64 words: status, request id, detail, count
TAG_REQUEST = 1
TAG_KEYS = 2
TAG_VALUES = 3
_REPLY_BASE = 16
WINDOW = 1 << 13   # request ids modulo this pick the reply tags; more in flight is an error


def reply_tags(request_id: int) -> tuple[int, int]:
    """The (header, data) tags of the reply to request ``request_id``."""
    slot = request_id % WINDOW
    return _REPLY_BASE + 2 * slot, _REPLY_BASE + 2 * slot + 1


class Op:
    """Request op codes (header word 0)."""
    CREATE = 1   # payload: the table's spec as UTF-8 JSON; reply detail: the table's id
    LOOKUP = 2   # payload: a table name; reply detail: its id; data: its spec
    PULL = 3     # keys (none with FLAG_WHOLE); reply data: the rows
    PUSH = 4     # keys and gradient rows; the server applies its optimizer
    ASSIGN = 5   # keys and rows written as they are (no optimizer)
    CLOCK = 6    # header word 4: the worker's new clock
    FINISH = 7   # the worker is done; no reply


FLAG_WHOLE = 1   # dense tables: the request covers the server's whole shard (no keys sent)


class Status:
    """Reply status codes (reply word 0); ``detail`` (word 2) qualifies them."""
    OK = 0
    UNKNOWN_TABLE = 1   # detail: the table id received
    BAD_SIZE = 2        # detail: the number of bytes received
    OUT_OF_RANGE = 3    # detail: the first key outside the table
    MISMATCH = 4        # a table of that name exists with another spec
    BAD_DTYPE = 5       # detail: the table's dtype code (the request's differs)


# The dtypes a table holds (its optimizers' arithmetic); on the wire a dtype is p2p's code.
TABLE_DTYPES = tuple(np.dtype(n) for n in ("float32", "float64", "float16", "int32", "int64"))


def dtype_code(dtype) -> int:
    """The wire code (``p2p.code_of``) of a table dtype; ``ValueError`` for one the tables do
    not hold."""
    dt = np.dtype(dtype)
    if dt not in TABLE_DTYPES:
        raise ValueError(f"tables hold {', '.join(str(d) for d in TABLE_DTYPES)}; got {dt}")
    return code_of(dt)
