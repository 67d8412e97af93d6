"""The model a plan splits: a GPT shape (``gpt(...)``), and what a layer of it holds and computes.

Vocabulary. ``h`` the width, ``a`` the heads, ``f`` the MLP's hidden width (``4 h``), ``s`` the
sequence, ``V`` the vocabulary, ``L`` the layers (blocks). A *layer* is one pre-norm block (two
LayerNorms with weight and bias, q/k/v and output projections without bias, a two-layer GELU
MLP without bias: examples/train_gpt.py's ``Block``); around the blocks sit the embedding
(``V h``), the final LayerNorm and the output head, tied to the embedding or not.

Precision. ``"fp32"``: parameters, gradients and activations in float32, AdamW's two moments in
float32 (16 bytes a parameter: what the toolkit's examples train with). ``"mixed"``: Megatron's
bf16 training with fp32 gradient accumulation and the distributed optimizer's fp32 master
weights and moments (2 + 4 + 12 = 18 bytes a parameter, activations in 2 bytes).
"""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["GPTShape", "gpt", "PRECISIONS"]

# precision: (parameter bytes, gradient bytes, optimizer-state bytes per parameter, activation
# bytes per element)
PRECISIONS = {"fp32": (4, 4, 8, 4), "mixed": (2, 4, 12, 2)}


@dataclass(frozen=True)
class GPTShape:
    """A GPT by its shape; ``attention`` is how the core is computed: ``"sdpa"`` (a fused
    kernel that keeps no scores) or ``"math"`` (written out: it keeps ``b a s^2`` scores)."""

    layers: int
    dim: int
    heads: int
    seq: int
    vocab: int
    ffn: int
    attention: str = "sdpa"
    tied: bool = True
    precision: str = "fp32"

    @property
    def bytes(self) -> tuple[int, int, int, int]:
        """(parameter, gradient, optimizer state per parameter, activation element) bytes."""
        return PRECISIONS[self.precision]

    def layer_params(self) -> int:
        """Parameters of one block."""
        h, f = self.dim, self.ffn
        return 4 * h * h + 2 * h * f + 4 * h

    def edge_params(self) -> tuple[int, int]:
        """Parameters of (the first stage's embedding, the last stage's norm and head); a tied
        head is the embedding's copy on the last stage (one process holds it once)."""
        return self.vocab * self.dim, 2 * self.dim + self.vocab * self.dim

    def params(self) -> int:
        """Parameters of the whole model on one process."""
        emb, last = self.edge_params()
        return emb + last - (self.vocab * self.dim if self.tied else 0) + \
            self.layers * self.layer_params()

    def layer_flops(self, b: int) -> float:
        """Forward floating-point operations of one block on ``b`` sequences (the matmuls:
        ``24 b s h^2 (f = 4h) + 4 b s^2 h``); backward is twice that."""
        s, h, f = self.seq, self.dim, self.ffn
        return 2 * b * s * (4 * h * h + 2 * h * f) + 4 * b * s * s * h

    def head_flops(self, b: int) -> float:
        """Forward floating-point operations of the output head on ``b`` sequences."""
        return 2 * b * self.seq * self.dim * self.vocab


def gpt(layers: int, dim: int, heads: int, seq: int, vocab: int, ffn: int | None = None,
        attention: str = "sdpa", tied: bool = True, precision: str = "fp32") -> GPTShape:
    """A GPT shape; checks what the planner relies on."""
    for what, n in (("layers", layers), ("dim", dim), ("heads", heads), ("seq", seq),
                    ("vocab", vocab)):
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"{what} must be a positive integer, got {n!r}")
    if dim % heads:
        raise ValueError(f"dim {dim} is not divisible by heads {heads}")
    if attention not in ("sdpa", "math"):
        raise ValueError(f"attention {attention!r}: expected 'sdpa' or 'math'")
    if precision not in PRECISIONS:
        raise ValueError(f"precision {precision!r}: expected one of {', '.join(PRECISIONS)}")
    return GPTShape(layers, dim, heads, seq, vocab, 4 * dim if ffn is None else ffn, attention,
                    tied, precision)
