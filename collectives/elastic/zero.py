"""ZeRO's shards kept redundantly, so that a lost rank's part of the state is rebuilt from its
copy and resharded over the survivors.

At a commit each rank of a ``ShardedDataParallel`` model (stage 1, 2 or 3) copies its own part
(``shard_state``: its flat shard of every unit and the optimizer's state of it; the module's
buffers) and exchanges it around a ring: rank r sends its part to rank r + 1 (mod n) and keeps
rank r - 1's. Every part is then held twice, on two ranks; on a node of several ranks, its
successor is usually on the same node (the ranks of a node are consecutive), so the copy
protects against a process's death, not a node's. The cost, one shard's bytes sent and received
per commit and twice the shard's memory, is the example's ``commit_ms`` beside ``step_ms``.

After a shrink (the model already rebuilt over the survivors, its units padded for their count)
the survivors exchange what they hold (an allgather of their own part and their copy): every
old rank's part is there unless two neighbouring ranks (r and r + 1) died at once, which is a
``ShardsLost`` error on every survivor. Each rank then rebuilds the whole state and keeps its
new shard (``load_shards``); the optimizer moves to the new shards.
"""
from __future__ import annotations

from ..errors import CollectiveError

__all__ = ["commit", "restore", "ShardsLost"]


class ShardsLost(CollectiveError):
    """A part of a sharded state and its copy were both on ranks that failed."""


def commit(model, optimizer) -> dict:
    """This rank's part of the state and its predecessor's copy (collective over
    ``model.comm``: a ring exchange)."""
    comm = model.comm
    r, n = comm.Get_rank(), comm.Get_size()
    own = model.shard_state(optimizer)
    held = comm.sendrecv(own, dest=(r + 1) % n, source=(r - 1) % n) if n > 1 else None
    return {"rank": r, "nranks": n, "own": own, "copy": held}


def restore(model, optimizer, saved: dict, comm) -> None:
    """Put back the committed state, resharded over ``comm`` (collective over it)."""
    pieces = comm.allgather((saved["rank"], saved["nranks"], saved["own"], saved["copy"]))
    n = pieces[0][1]
    parts = [None] * n
    for r, _, own, held in pieces:
        parts[r] = own
    for r, _, _, held in pieces:
        if held is not None and parts[(r - 1) % n] is None:
            parts[(r - 1) % n] = held
    lost = [r for r, p in enumerate(parts) if p is None]
    if lost:
        raise ShardsLost(f"the shards of ranks {lost} of {n} and their copies were all on "
                         f"ranks that failed")
    model.load_shards(optimizer, parts)
