"""Bounds on float32 rounding, for tests that compare two computations of one quantity.

``U`` is float32's unit roundoff, 2^-24: every operation's result is within ``U`` of the exact
one, relatively. A sum or a dot product of ``n`` terms, added in any order (any blocking, any
SIMD width, any number of ranks), is within ``gamma(n) * sum |terms|`` of the exact value
(``gamma(n) = n U / (1 - n U)``; Higham, *Accuracy and Stability of Numerical Algorithms*, 3.1).
A value computed through a chain of reductions of lengths ``n1, n2, ...`` (a network's layers,
forward then backward) is, to first order, within ``gamma(n1 + n2 + ...)`` of its scale. Two
computations of it (one process, and the ranks with their own orders and kernels) differ by at
most twice that: ``agree(n, scale)``.

SGD turns such a bound on gradients into one on parameters, since its step is proportional to
the gradient: ``sgd_parameters(lr, n, gradient_scales, parameter_scale, momentum)`` (a momentum
buffer is a linear combination of the gradients, so the bound carries over). Adam's is not: its
step is about ``lr`` whatever the gradient's size, so a last-bit difference in a gradient near
zero moves a weight by up to ``2 lr``, and no bound tighter than ``2 lr`` per step holds; tests
that compare parameters after Adam steps with tolerances far below that pass or fail by the
CPU's kernels, not by the code's correctness.
"""
from __future__ import annotations

__all__ = ["U", "BF16_U", "gamma", "agree", "average", "sgd_parameters"]

U = 2.0 ** -24
BF16_U = 2.0 ** -8   # bfloat16's unit roundoff (8 significant bits)


def gamma(n: int, unit: float = U) -> float:
    """``n U / (1 - n U)``: the relative error of a sum of ``n`` terms in float32 (in another
    format with its unit roundoff ``unit``)."""
    assert n * unit < 1, n
    return n * unit / (1 - n * unit)


def agree(n: int, scale: float) -> float:
    """How far two float32 computations of a value through reductions of ``n`` terms in all
    may differ, where ``scale`` bounds the terms' magnitude."""
    return 2 * gamma(n) * scale


def average(n: int, scale, unit: float = U):
    """How far a mean over ``n`` ranks, each input divided by ``n`` and the quotients summed in
    any order (``op="avg"``: ``n`` roundings), may lie from the exact mean, where ``scale``
    (a number, or an array for element-wise bounds) is the mean of the inputs' magnitudes:
    ``gamma(n + 1) * scale``, one rounding to spare for a float64 reference's own."""
    return gamma(n + 1, unit) * scale


def sgd_parameters(lr: float, n: int, gradient_scales, parameter_scale: float,
                   momentum: float = 0.0) -> float:
    """How far one parameter tensor may differ between two runs of SGD (``p -= lr * g``, or
    with ``momentum`` torch's ``b = momentum * b + g; p -= lr * b``) from the same start, given
    the largest gradient of each step (``gradient_scales``), the largest parameter
    (``parameter_scale``) and the gradients' reduction length ``n``: each step adds ``lr``
    times the buffers' disagreement (the gradients', plus ``momentum`` times the last one's, plus
    the buffer's two roundings ``2 U |b|`` in each run from the second step on), and each run
    rounds every update once (``lr * b``, then ``p - lr * b``: ``U (p + 2 lr b)`` in each
    run)."""
    bound, differ, buffer = 0.0, 0.0, 0.0
    for step, g in enumerate(gradient_scales):
        buffer = momentum * buffer + g
        rounded = 2 * 2 * U * buffer if momentum and step else 0.0
        differ = momentum * differ + agree(n, g) + rounded
        bound += lr * differ + 2 * U * (parameter_scale + 2 * lr * buffer)
    return bound
