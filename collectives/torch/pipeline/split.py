"""``pp.split``: cut a sequential model into pipeline stages at named modules.

    stages = pp.split(model, points=["layers.4", "layers.8"])    # 3 stages
    mine = [stages[s] for s in sched.local_stages(rank)]

``model`` runs its children in order (an ``nn.Sequential``, nested ones included): its pieces
are its children, a nested ``nn.Sequential`` opened into its own children, named as in
``model.named_modules()``. Each point names the piece that starts a new stage; stage k is an
``nn.Sequential`` of the pieces from point k - 1 to point k, sharing their parameters with
``model`` (nothing is copied). A model whose ``forward`` does more than call its children in
order cannot be cut by names: build its stage modules directly.
"""
from __future__ import annotations

from torch import nn

__all__ = ["split", "pieces"]


def pieces(model: nn.Module, prefix: str = "") -> list[tuple[str, nn.Module]]:
    """``model``'s pieces in the order it runs them: (qualified name, module)."""
    if not isinstance(model, nn.Sequential):
        raise ValueError(f"split cuts nn.Sequential models (nested ones included); "
                         f"{type(model).__name__} has its own forward: pass stage modules "
                         f"to pp.Pipeline directly")
    out = []
    for name, child in model.named_children():
        full = f"{prefix}{name}"
        if isinstance(child, nn.Sequential):
            out += pieces(child, full + ".")
        else:
            out.append((full, child))
    return out


def split(model: nn.Module, points) -> list[nn.Sequential]:
    """``len(points) + 1`` stages of ``model``, each starting at its point (the first at the
    first piece)."""
    found = pieces(model)
    names = [n for n, _ in found]
    starts = [0]
    for point in points:
        if point not in names:
            raise ValueError(f"no piece named {point!r} in the model; the pieces are "
                             f"{', '.join(names)}")
        at = names.index(point)
        if at <= starts[-1]:
            raise ValueError(f"split points must name pieces in model order, each after the "
                             f"one before and after the first piece; {point!r} is piece {at}")
        starts.append(at)
    ends = starts[1:] + [len(found)]
    return [nn.Sequential(*(m for _, m in found[a:b])) for a, b in zip(starts, ends)]
