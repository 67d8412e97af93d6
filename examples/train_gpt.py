"""A small GPT-style decoder trained with tensor (and sequence) parallelism times data parallelism.

    mpiexec -n 2 python examples/train_gpt.py --tp 2                      # tensor parallel
    mpiexec -n 2 python examples/train_gpt.py --tp 2 --sequence-parallel
    mpiexec -n 4 python examples/train_gpt.py --tp 2 --dp 2 --zero 2      # 2-D: ZeRO-2 on dp
    mpiexec -n 8 python examples/train_gpt.py --pp 2 --tp 2 --dp 2        # 3-D: pipelined

The model: a token embedding, ``--layers`` pre-norm blocks (causal self-attention, its heads
split across the tensor-parallel ranks; a GELU MLP; two LayerNorms), a final LayerNorm and an
output head tied to the embedding; no positional embedding (the causal mask carries the order).
Linear layers have no bias, so every tensor-parallel layer is split whole. The fused q/k/v
projection holds its rows head by head (q, k, v of head 0, then of head 1, ...), so a
column-parallel split in whole heads (the plan's ``colwise:3*head_dim``) gives each rank its own
heads, and the attention reads its number of heads from the tensor, never from a constant.

The corpus: the bytes of the Python standard library's top-level ``*.py`` files in sorted order
(``--corpus-bytes`` of them), one token per byte, the vocabulary padded to ``--vocab`` (a
multiple of the tensor-parallel size). Step s draws ``--batch`` windows of ``--seq`` + 1 tokens
from a generator seeded with (``--seed``, s); data-parallel rank d trains on its ``batch / dp``
rows. The ranks form ``Mesh((dp, tp), ("dp", "tp"))``; the model is converted by
``tensor_parallel.parallelize`` over ``mesh.comm("tp")`` and wrapped in ``DistributedDataParallel``
(``--zero 0``) or ``ShardedDataParallel`` (``--zero 1`` or ``2``) over ``mesh.comm("dp")``.

Rank 0 prints the loss of every step, then a JSON summary as the last line: the final loss,
tokens/s (the global batch's tokens over the median step time), the bytes per step this rank sends
in the tensor-parallel collectives (``tensor_parallel.traffic``) and in the data-parallel ones,
both counted as a bandwidth-optimal algorithm sends them (nccl-tests' bus bytes), and the
tensor-parallel layers' parameter bytes on this rank against their full size.
"""
import argparse
import glob
import json
import os
import statistics
import sys
import sysconfig
import time

os.environ.setdefault("MPIR_CVAR_CH4_PROGRESS_THROTTLE", "1")  # see train_ddp.py

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

__all__ = ["GPT", "plan", "corpus", "batch", "build", "train", "pipelined", "measured_compute",
           "shape", "node_layout", "choose", "warm_up", "run", "main"]


class AttentionCore(nn.Module):
    """``softmax(q k^T / sqrt(d)) v`` under a causal mask, per head: torch's fused kernel
    (``"sdpa"``, which keeps no scores for backward) or written out (``"math"``, which keeps the
    softmax, ``b a s^2`` elements per layer: what selective recompute removes)."""

    def __init__(self, kind: str = "sdpa"):
        super().__init__()
        if kind not in ("sdpa", "math"):
            raise ValueError(f"attention {kind!r}: expected 'sdpa' or 'math'")
        self.kind = kind

    def forward(self, q, k, v):
        if self.kind == "sdpa":
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        t = q.shape[-2]
        scores = (q @ k.transpose(-2, -1)) * q.shape[-1] ** -0.5
        mask = torch.ones(t, t, dtype=torch.bool, device=q.device).triu_(1)
        return scores.masked_fill_(mask, float("-inf")).softmax(dim=-1) @ v


class Attention(nn.Module):
    """Causal self-attention; q/k/v rows grouped by head."""

    def __init__(self, dim: int, heads: int, attention: str = "sdpa"):
        super().__init__()
        if dim % heads:
            raise ValueError(f"dim {dim} is not divisible by heads {heads}")
        self.head_dim = dim // heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.core = AttentionCore(attention)
        self.proj = nn.Linear(dim, dim, bias=False)

    def forward(self, x):
        qkv = self.qkv(x)
        b, t, f = qkv.shape  # t is the whole sequence, f this rank's heads' q, k and v
        q, k, v = qkv.view(b, t, f // (3 * self.head_dim), 3, self.head_dim).unbind(3)
        y = self.core(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        return self.proj(y.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    """Two linear layers around a GELU."""

    def __init__(self, dim: int):
        super().__init__()
        self.fc1 = nn.Linear(dim, 4 * dim, bias=False)
        self.fc2 = nn.Linear(4 * dim, dim, bias=False)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


class Block(nn.Module):
    """Pre-norm residual block."""

    def __init__(self, dim: int, heads: int, attention: str = "sdpa"):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn, self.mlp = Attention(dim, heads, attention), MLP(dim)

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class GPT(nn.Module):
    """Token embedding, blocks, final norm, head tied to the embedding."""

    def __init__(self, vocab: int, dim: int, heads: int, layers: int, attention: str = "sdpa"):
        super().__init__()
        self.heads = heads
        self.embed = nn.Embedding(vocab, dim)
        nn.init.normal_(self.embed.weight, std=0.02)
        self.blocks = nn.ModuleList(Block(dim, heads, attention) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids):
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def plan(model: GPT, sequence_parallel: bool, recompute: str = "none") -> dict:
    """The tensor-parallel plan of ``GPT``: attention heads and MLP columns split, vocabulary
    split, norms marked for sequence parallelism, the modules ``recompute`` names (none,
    selective: the attention core, full: whole blocks) marked for activation checkpointing."""
    from collectives.torch.checkpoint import GPT_POLICIES
    hd = model.blocks[0].attn.head_dim
    out = {"embed": "vocab", "head": "colwise",
           "blocks.*.attn.qkv": f"colwise:{3 * hd}", "blocks.*.attn.proj": f"rowwise:{hd}",
           "blocks.*.mlp.fc1": "colwise", "blocks.*.mlp.fc2": "rowwise"}
    if sequence_parallel:
        out.update({"blocks.*.norm*": "sequence", "norm": "sequence"})
    out.update({p: "recompute" for p in GPT_POLICIES[recompute]})
    return out


def corpus(nbytes: int) -> torch.Tensor:
    """The first ``nbytes`` bytes of the standard library's top-level sources, as int64 ids."""
    out, have = [], 0
    for path in sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py"))):
        with open(path, "rb") as f:
            data = f.read(nbytes - have)
        out.append(data)
        have += len(data)
        if have >= nbytes:
            break
    return torch.frombuffer(bytearray(b"".join(out)), dtype=torch.uint8).long()


def batch(text: torch.Tensor, step: int, rows: int, seq: int, seed: int):
    """Step ``step``'s ``rows`` windows: inputs and next-token targets, (rows, seq) each."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    start = torch.randint(0, len(text) - seq - 1, (rows,), generator=g)
    win = text[start.unsqueeze(1) + torch.arange(seq + 1)]
    return win[:, :-1], win[:, 1:]


def build(args, mesh=None):
    """The model on this rank: plain (``mesh`` None) or parallelized over the mesh's "tp"
    axis and wrapped for data parallelism over its "dp" axis. Returns (model, inner, optimizer,
    loss function)."""
    from collectives.torch import DistributedDataParallel, ShardedDataParallel
    from collectives.torch import tensor_parallel as tp
    from collectives.torch import checkpoint
    torch.manual_seed(args.seed)
    model = GPT(args.vocab, args.dim, args.heads, args.layers, args.attention)
    if mesh is None:
        if args.recompute != "none":
            checkpoint.recompute(model, checkpoint.GPT_POLICIES[args.recompute])
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
        return model, model, opt, lambda logits, y: F.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
    tp_comm, dp_comm = mesh.comm("tp"), mesh.comm("dp")
    if args.heads % tp_comm.Get_size():
        # the plan's unit says the same for blocks.*.attn.qkv; this names the model's setting
        raise ValueError(f"--heads {args.heads} is not divisible by --tp {tp_comm.Get_size()}")
    tp.parallelize(model, tp_comm, plan(model, args.sequence_parallel, args.recompute))
    if args.zero:
        wrapped = ShardedDataParallel(model, stage=args.zero, comm=dp_comm)
    else:
        wrapped = DistributedDataParallel(model, comm=dp_comm)
    opt = torch.optim.AdamW(wrapped.parameters(), lr=args.lr)
    return wrapped, model, opt, lambda logits, y: tp.vocab_parallel_cross_entropy(
        logits, y, tp_comm)


def train(args, mesh=None, text=None, on_step=None):
    """Train for ``args.steps``; returns (losses, step times, model, inner module). With a mesh,
    this rank trains on its data-parallel slice and the loss is averaged over "dp"."""
    import collectives as coll
    text = corpus(args.corpus_bytes) if text is None else text
    model, inner, opt, loss_fn = build(args, mesh)
    dp = 1 if mesh is None else mesh.size("dp")
    if args.batch % dp:
        raise ValueError(f"--batch {args.batch} is not divisible by --dp {dp}")
    rows = args.batch // dp
    me = 0 if mesh is None else mesh.coord("dp")
    losses, times = [], []
    for step in range(args.steps):
        x, y = batch(text, step, args.batch, args.seq, args.seed)
        x, y = x[me * rows:(me + 1) * rows], y[me * rows:(me + 1) * rows]
        t0 = time.perf_counter()
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - t0)
        value = loss.detach().reshape(1)
        if dp > 1:
            value = coll.allreduce(value, op="avg", comm=mesh.comm("dp"))
        losses.append(float(value))
        if on_step:
            on_step(step, losses[-1])
    return losses, times, model, inner


def parser():
    """The example's flags."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pp", type=int, default=1,
                   help="pipeline stages (1); > 1 trains pp x dp x tp (collectives.torch.pipeline)")
    p.add_argument("--schedule", default="1f1b",
                   help="pipeline schedule: gpipe, 1f1b, interleaved, zero_bubble (1f1b)")
    p.add_argument("--microbatches", type=int, default=4, help="pipeline micro-batches (4)")
    p.add_argument("--virtual", type=int, default=1,
                   help="pipeline stages per rank, for the interleaved schedule (1)")
    p.add_argument("--plan", default=None, choices=("auto",),
                   help="auto: run the fastest plan the planner (collectives.plan) finds for "
                        "this model, the job's ranks and --memory-per-rank; overrides --dp, "
                        "--tp, --pp, --schedule, --virtual, --microbatches, --zero, "
                        "--recompute and --sequence-parallel")
    p.add_argument("--memory-per-rank", default=None,
                   help="bytes a rank may hold, with --plan auto (3000000, 512M, 2G)")
    p.add_argument("--tp", type=int, default=None, help="tensor-parallel size (ranks / dp)")
    p.add_argument("--dp", type=int, default=1, help="data-parallel size (1)")
    p.add_argument("--sequence-parallel", action="store_true")
    # ZeRO-3 frees a layer's parameters after its forward, and the head reads the embedding's
    # weight after the embedding's forward: stage 3 does not support a shared weight
    p.add_argument("--zero", type=int, default=0, choices=(0, 1, 2),
                   help="data parallelism: 0 DistributedDataParallel, 1-2 ZeRO stage (0)")
    p.add_argument("--recompute", default="none", choices=("none", "selective", "full"),
                   help="activation checkpointing: none, selective (the attention core), "
                        "full (whole blocks) (none)")
    p.add_argument("--attention", default="sdpa", choices=("sdpa", "math"),
                   help="attention core: torch's fused kernel, or written out, keeping its "
                        "b a s^2 scores for backward (sdpa)")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vocab", type=int, default=264, help="byte vocabulary, padded (264)")
    p.add_argument("--dim", type=int, default=96)
    p.add_argument("--heads", type=int, default=6)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--seq", type=int, default=96, help="tokens per window (96)")
    p.add_argument("--batch", type=int, default=8, help="windows per step, global (8)")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--corpus-bytes", type=int, default=1 << 20)
    return p


def measured_compute(repeats: int = 5):
    """The planner's compute for this model, measured on this machine: one ``Block`` with a
    tensor-parallel rank's share of the heads and MLP columns, and the norm, head and loss."""
    from collectives import plan as planner

    def block(shape, tp):
        blk = Block(shape.dim, shape.heads, shape.attention)
        width = shape.dim // tp     # this rank's heads, whole
        blk.attn.qkv = nn.Linear(shape.dim, 3 * width, bias=False)
        blk.attn.proj = nn.Linear(width, shape.dim, bias=False)
        blk.mlp.fc1 = nn.Linear(shape.dim, shape.ffn // tp, bias=False)
        blk.mlp.fc2 = nn.Linear(shape.ffn // tp, shape.dim, bias=False)
        return blk

    class Head(nn.Module):
        def __init__(self, dim, vocab):
            super().__init__()
            self.norm, self.head = nn.LayerNorm(dim), nn.Linear(dim, vocab, bias=False)

        def forward(self, x, y):
            z = self.head(self.norm(x))
            return F.cross_entropy(z.reshape(-1, z.shape[-1]), y.reshape(-1))

    return planner.Measured(block, Head, repeats=repeats)


def shape(args):
    """The planner's description of this model."""
    from collectives import plan as planner
    return planner.gpt(args.layers, args.dim, args.heads, args.seq, args.vocab,
                       attention=args.attention)


def node_layout(world) -> tuple[int, int]:
    """(ranks on this node, cores this process may run on): what the planner prices."""
    from mpi4py import MPI
    node = world.Split_type(MPI.COMM_TYPE_SHARED)
    ranks = node.Get_size()
    node.Free()
    return ranks, len(os.sched_getaffinity(0))


def choose(args, world, compute=None):
    """``--plan auto``: the fastest plan this example runs on the job's ranks under
    ``--memory-per-rank``. Every rank searches, so the block's compute is measured while all
    of the node's ranks compute (the cores shared as in training); rank 0's choice is every
    rank's. ``args`` is updated in place; returns the chosen ``Plan``."""
    from collectives import plan as planner
    ranks_per_node, _ = node_layout(world)
    net = planner.calibrated(ranks_per_node=ranks_per_node)
    plans = planner.search(shape(args), world.Get_size(), args.batch, args.memory_per_rank,
                           ranks_per_node, net, compute or measured_compute(), top=1,
                           runnable=True)
    found = world.bcast(plans[0] if plans else None, root=0)
    if found is None:
        raise SystemExit(f"no plan of this model fits --memory-per-rank {args.memory_per_rank} "
                         f"on {world.Get_size()} ranks")
    args.dp, args.tp, args.pp, args.zero = found.dp, found.tp, found.pp, found.zero
    args.recompute, args.sequence_parallel = found.recompute, found.sequence_parallel
    args.schedule, args.virtual, args.microbatches = (found.schedule, found.virtual,
                                                      found.microbatches)
    return found


def warm_up(args, world, text) -> None:
    """Two steps of the same plan (mesh, wrappers, schedule, recompute) at the same widths,
    sequence and micro-batches, with one block a stage: the code and the first-use
    allocations of the libraries, which depend on the sizes of the matrices and messages
    (the math library's and the MPI library's buffers for large operands), are then held
    before ``run`` takes its baseline, and what it measures is the model's. The C heap's free
    pages go back to the system first (``measure.trim``): the heap the plan finds free is then
    its warm-up's, the same whichever plans ran before it in the process."""
    from collectives.plan import measure
    measure.trim()
    warm = argparse.Namespace(**vars(args))
    warm.layers, warm.steps = args.pp * args.virtual, 2
    run(warm, world, text)


def run(args, world, text, on_step=None) -> dict:
    """Train by ``args`` on ``world``'s ranks; returns the summary (the same on every rank):
    loss, step time, bytes, and ``peak_bytes``: the most any rank's resident set rose over what
    it held before the model was built (``collectives.plan.measure``)."""
    import gc

    from mpi4py import MPI

    from collectives import Mesh
    from collectives.plan import measure
    from collectives.torch import tensor_parallel as tp
    tp_size = args.tp or world.Get_size() // (args.dp * args.pp)
    gc.collect()
    base = measure.reset_peak()
    if args.pp > 1:
        mesh = Mesh((args.pp, args.dp, tp_size), ("pp", "dp", "tp"), comm=world)
        summary = pipelined(args, mesh, text, on_step)
    else:
        mesh = Mesh((args.dp, tp_size), ("dp", "tp"), comm=world)
        tp.traffic.reset()
        losses, times, model, inner = train(args, mesh, text, on_step)
        here, full = tp.sharded_parameter_bytes(inner)
        # DDP's allreduce, ZeRO's reduce-scatter plus all-gather: 2(dp-1)/dp of the gradients
        grads = sum(p.numel() * p.element_size() for p in inner.parameters())
        dp_bytes = 2 * (args.dp - 1) * grads // args.dp
        median = statistics.median(times[1:] or times)
        summary = {"tp": tp_size, "dp": args.dp, "sequence_parallel": args.sequence_parallel,
                   "zero": args.zero, "recompute": args.recompute, "steps": args.steps,
                   "loss": round(losses[-1], 5), "losses": [round(x, 6) for x in losses],
                   "tokens_per_s": round(args.batch * args.seq / median, 1),
                   "step_ms": round(median * 1e3, 2),
                   "tp_bytes_per_step": tp.traffic.total() // args.steps,
                   "dp_bytes_per_step": dp_bytes,
                   "tp_param_bytes_per_rank": here, "tp_param_bytes_full": full,
                   "param_bytes_per_rank": sum(p.numel() * p.element_size()
                                               for p in inner.parameters())}
        del model, inner
    summary["peak_bytes"] = world.allreduce(measure.peak() - base, op=MPI.MAX)
    # the plan's wrappers are gone: its communicators and their shared windows go too, so
    # that MPI's tables stay at the most one plan holds (a warm-up's windows left alive
    # would make the measured plan's grow them, in its peak)
    gc.collect()
    mesh.free()
    return summary


def main(argv=None):
    args = parser().parse_args(argv)
    from mpi4py import MPI

    from collectives import plan as planner
    from collectives.plan import measure
    measure.steady_allocator()
    torch.set_num_threads(1)
    world = MPI.COMM_WORLD
    rank0 = world.Get_rank() == 0
    chosen = None
    if args.plan == "auto":
        chosen = choose(args, world)
        if rank0:
            print(f"plan: {chosen.name()} (predicted {chosen.memory} bytes a rank, "
                  f"{chosen.step_time * 1e3:.1f} ms a step)", flush=True)
    elif args.memory_per_rank is not None:
        raise SystemExit("--memory-per-rank goes with --plan auto")

    def show(step, loss):
        if rank0:
            print(f"step {step}: loss {loss:.4f}", flush=True)

    text = corpus(args.corpus_bytes)
    warm_up(args, world, text)
    summary = run(args, world, text, show)
    if chosen is not None:
        summary.update(plan=chosen.name(), predicted_peak_bytes=chosen.memory,
                       predicted_step_ms=round(chosen.step_time * 1e3, 2),
                       memory_per_rank=planner.parse_bytes(args.memory_per_rank)
                       if args.memory_per_rank else None)
    if rank0:
        print(json.dumps(summary), flush=True)


def pipelined(args, mesh, text=None, on_step=None) -> dict:
    """``--pp`` > 1: the model cut into pipeline stages (collectives.torch.pipeline.gpt), each
    tensor-parallel over "tp" and data-parallel over "dp" (DDP, or ZeRO-1 with --zero 1);
    returns the summary."""
    from collectives.torch import tensor_parallel as tp
    from collectives.torch.pipeline import gpt as pgpt
    tp_comm, dp, me = mesh.comm("tp"), mesh.size("dp"), mesh.coord("dp")
    if args.batch % dp:
        raise ValueError(f"--batch {args.batch} is not divisible by --dp {dp}")
    torch.manual_seed(args.seed)
    model = GPT(args.vocab, args.dim, args.heads, args.layers, args.attention)
    tp.parallelize(model, tp_comm, plan(model, args.sequence_parallel, args.recompute))
    job = pgpt.PipelinedGPT(model, mesh, schedule=args.schedule, microbatches=args.microbatches,
                            virtual=args.virtual,
                            loss_fn=lambda z, y: tp.vocab_parallel_cross_entropy(z, y, tp_comm),
                            zero=args.zero)
    # this rank trains its stages only: the rest of the model it built goes now, not with
    # the function's frame after the last step
    del model
    opt = torch.optim.AdamW(list(job.parameters()), lr=args.lr)
    text = corpus(args.corpus_bytes) if text is None else text
    rows = args.batch // dp

    def batches(step):
        x, y = batch(text, step, args.batch, args.seq, args.seed)
        return x[me * rows:(me + 1) * rows], y[me * rows:(me + 1) * rows]

    losses, times = pgpt.train(job, opt, batches, args.steps, mesh, on_step=on_step)
    median = statistics.median(times[1:] or times)
    return {"pp": mesh.size("pp"), "tp": mesh.size("tp"), "dp": dp,
            "sequence_parallel": args.sequence_parallel, "schedule": args.schedule,
            "virtual": args.virtual, "microbatches": args.microbatches, "zero": args.zero,
            "recompute": args.recompute, "steps": args.steps, "loss": round(losses[-1], 5),
            "losses": [round(x, 6) for x in losses],
            "tokens_per_s": round(args.batch * args.seq / median, 1),
            "step_ms": round(median * 1e3, 2)}


if __name__ == "__main__":
    sys.exit(main())
