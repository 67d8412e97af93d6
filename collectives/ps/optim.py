"""Server-side optimizers, applied to the rows a push touches: SGD, momentum, Adagrad, Adam.

Each optimizer keeps its state in arrays shaped like the shard's rows (a sparse shard grows
them with its rows) and updates only the rows indexed by ``idx``: a slice (a dense table's
whole shard: views, updated in place) or an int64 array of distinct slots (a sparse push is
deduplicated on the worker, so fancy-indexed writes never collide). Adam keeps a step count
per row, so a row's bias correction counts the pushes that touched it ("lazy" Adam, as
TensorFlow's LazyAdam and torch's SparseAdam do for embeddings).
"""
from __future__ import annotations

import numpy as np

__all__ = ["OPTIMIZERS", "Optimizer", "SGD", "Momentum", "Adagrad", "Adam", "make"]


class Optimizer:
    """Base: ``lr`` and the state arrays named in ``STATE``, grown with ``resize``."""
    STATE: tuple = ()

    def __init__(self, rows: int, dim: int, dtype, lr: float, **options):
        self.lr = float(lr)
        self.dtype = np.dtype(dtype)
        self.state = {name: np.zeros((rows, dim), dtype=self.dtype) for name in self.STATE}
        for key, value in options.items():
            setattr(self, key, float(value))

    def resize(self, rows: int) -> None:
        """Grow the state to ``rows`` rows (new rows zero)."""
        for name, old in self.state.items():
            new = np.zeros((rows,) + old.shape[1:], dtype=old.dtype)
            new[:len(old)] = old
            self.state[name] = new

    def apply(self, w: np.ndarray, idx, g: np.ndarray) -> None:
        """Update rows ``w[idx]`` in place with gradient rows ``g``."""
        raise NotImplementedError


class SGD(Optimizer):
    """``w -= lr * g``."""

    def apply(self, w, idx, g):
        if isinstance(idx, slice):
            w[idx] -= self.lr * g
        else:
            w[idx] = w[idx] - self.lr * g


class Momentum(Optimizer):
    """Heavy ball, as torch.optim.SGD(momentum=mu): ``m = mu * m + g; w -= lr * m``."""
    STATE = ("m",)
    momentum = 0.9

    def apply(self, w, idx, g):
        m = self.state["m"]
        mi = self.momentum * m[idx] + g
        m[idx] = mi
        if isinstance(idx, slice):
            w[idx] -= self.lr * mi
        else:
            w[idx] = w[idx] - self.lr * mi


class Adagrad(Optimizer):
    """``a += g*g; w -= lr * g / (sqrt(a) + eps)``, as torch.optim.Adagrad."""
    STATE = ("a",)
    eps = 1e-10

    def apply(self, w, idx, g):
        a = self.state["a"]
        ai = a[idx] + g * g
        a[idx] = ai
        step = g / (np.sqrt(ai) + self.eps)
        if isinstance(idx, slice):
            w[idx] -= self.lr * step
        else:
            w[idx] = w[idx] - self.lr * step


class Adam(Optimizer):
    """Adam with a step count per row (lazy: untouched rows keep their moments)."""
    STATE = ("m", "v", "t")
    beta1 = 0.9
    beta2 = 0.999
    eps = 1e-8

    def apply(self, w, idx, g):
        m, v, t = self.state["m"], self.state["v"], self.state["t"]
        ti = t[idx] + 1
        t[idx] = ti
        mi = self.beta1 * m[idx] + (1 - self.beta1) * g
        vi = self.beta2 * v[idx] + (1 - self.beta2) * (g * g)
        m[idx] = mi
        v[idx] = vi
        mhat = mi / (1 - self.beta1 ** ti)
        vhat = vi / (1 - self.beta2 ** ti)
        step = (self.lr * mhat / (np.sqrt(vhat) + self.eps)).astype(self.dtype, copy=False)
        if isinstance(idx, slice):
            w[idx] -= step
        else:
            w[idx] = w[idx] - step


OPTIMIZERS = {"sgd": SGD, "momentum": Momentum, "adagrad": Adagrad, "adam": Adam}
_OPTIONS = {"sgd": (), "momentum": ("momentum",), "adagrad": ("eps",),
            "adam": ("beta1", "beta2", "eps")}


def make(name: str, rows: int, dim: int, dtype, lr: float, options: dict) -> Optimizer:
    """The optimizer ``name`` for a shard of ``rows`` x ``dim`` (``ValueError`` naming the
    choices for an unknown name or option)."""
    if name not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {name!r}; choose one of {', '.join(OPTIMIZERS)}")
    bad = sorted(set(options) - set(_OPTIONS[name]))
    if bad:
        raise ValueError(f"optimizer {name!r} takes options {list(_OPTIONS[name])}, got {bad}")
    if not lr > 0:
        raise ValueError(f"lr must be positive, got {lr}")
    return OPTIMIZERS[name](rows, dim, dtype, lr, **options)
