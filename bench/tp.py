"""Tensor-parallel training step: the toolkit's layers against torch's DTensor, in one run.

    mpiexec -n 2 python -m bench tp                      # via the bench dispatcher
    mpiexec -n 2 python -m bench tp --rounds 10 --steps 3 --sequence-parallel

The model is examples/train_gpt.py's GPT (``--dim``, ``--heads``, ``--layers``, vocabulary
``--vocab``), the batch ``--batch`` windows of ``--seq`` tokens of its corpus, every rank in one
tensor-parallel group (tp = n), AdamW in fp32, one torch thread per rank. Variants, each built
once from the same full weights and stepped in interleaved rounds, so load from other jobs hits
them alike:

- ``ours``: ``collectives.torch.tensor_parallel.parallelize`` (the GPT's plan: vocab-parallel
  embedding, heads and MLP columns split, head tied to the embedding) and
  ``vocab_parallel_cross_entropy``, on ``Mesh((n,), ("tp",)).comm("tp")``.
- ``dtensor-gloo``: torch's own tensor parallelism, ``parallelize_module`` with the same split
  (``RowwiseParallel`` embedding, ``ColwiseParallel`` q/k/v, fc1 and head, ``RowwiseParallel``
  proj and fc2; the head re-tied to the embedding) and ``loss_parallel``, on a ``DeviceMesh`` of a
  gloo group.
- ``dtensor-ours``: the same DTensor model on a ``DeviceMesh`` of the toolkit's backend
  (``mesh.group("tp")``).

With ``--tp T`` below n, the ranks form n / T tensor-parallel groups, each stepping the model
on its own (the DTensor variants need T = n): ``ours`` on ``Mesh((n / T, T), ("dp", "tp"))``,
whose groups are consecutive ranks (on one host, where a host holds T consecutive ranks), and
``ours-across`` on ``Mesh((T, n / T), ("tp", "dp"))``, whose groups take every (n / T)-th rank
(one a host on ``bench cluster --nodes T``): the placement is the mesh's axis order. Where the
ranks' hosts have an ``eth0`` (``bench cluster``), the table also shows the bytes a step sent
over the busiest host's link, by the kernel's counter.

A step (forward, loss, backward, AdamW step, zero_grad) is timed as the slowest rank's. The
table shows per variant the median step, the spread of the rounds (interquartile range over the
median), the ratio to ``dtensor-gloo``, and the first step's loss (the same for every variant:
they start from the same weights and batch).
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

__all__ = ["main", "VARIANTS", "train_gpt_module"]

VARIANTS = ("ours", "dtensor-gloo", "dtensor-ours", "ours-across")


def train_gpt_module():
    """examples/train_gpt.py as a module (its model, plan and corpus), loaded from its path:
    the examples are scripts beside the package, not an installed module."""
    import importlib.util
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                        "examples", "train_gpt.py")
    spec = importlib.util.spec_from_file_location("train_gpt", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _dtensor(model, device_mesh):
    """``model`` parallelized by torch's ``parallelize_module`` like the toolkit's plan."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)
    plan = {"embed": RowwiseParallel(input_layouts=Replicate()),
            "head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)}
    for i in range(len(model.blocks)):
        plan.update({f"blocks.{i}.attn.qkv": ColwiseParallel(),
                     f"blocks.{i}.attn.proj": RowwiseParallel(),
                     f"blocks.{i}.mlp.fc1": ColwiseParallel(),
                     f"blocks.{i}.mlp.fc2": RowwiseParallel()})
    parallelize_module(model, device_mesh, plan)
    model.head.weight = model.embed.weight  # both Shard(0): the tie holds on the shards
    return model


def main(argv=None) -> int:
    """Run the comparison and print the table on rank 0."""
    p = argparse.ArgumentParser(prog="python -m bench tp", description=__doc__.split("\n")[0])
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--vocab", type=int, default=264)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--rounds", type=int, default=8, help="interleaved rounds (8)")
    p.add_argument("--steps", type=int, default=3, help="timed steps per variant per round (3)")
    p.add_argument("--sequence-parallel", action="store_true",
                   help="ours with sequence parallelism (the DTensor variants without)")
    p.add_argument("--variants", default=None,
                   help=f"comma-separated subset of {', '.join(VARIANTS)} (default: the first "
                        f"three at tp = n, ours and ours-across below)")
    p.add_argument("--tp", type=int, default=None, help="tensor-parallel group size (n)")
    args = p.parse_args(argv)
    os.environ.setdefault("MPIR_CVAR_CH4_PROGRESS_THROTTLE", "1")
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from mpi4py import MPI
    from torch.distributed.device_mesh import DeviceMesh

    import collectives.torch.backend as cb
    from bench.stats import spread
    from collectives import Mesh
    from collectives.torch import tensor_parallel as tp
    train_gpt = train_gpt_module()
    torch.set_num_threads(1)
    comm = MPI.COMM_WORLD
    n = comm.Get_size()
    size = args.tp or n
    if size < 1 or n % size:
        raise SystemExit(f"--tp {size} does not divide the {n} ranks")
    default = VARIANTS[:3] if size == n else ("ours", "ours-across")
    names = [v for v in (args.variants or ",".join(default)).split(",") if v]
    bad = [v for v in names if v not in VARIANTS]
    if bad:
        raise SystemExit(f"unknown variants {bad}; choose from {list(VARIANTS)}")
    if size != n and any(v.startswith("dtensor") for v in names):
        raise SystemExit("the DTensor variants run on every rank (--tp n)")
    cb.init_process_group(store=cb.tcp_store())
    mesh = Mesh((n // size, size), ("dp", "tp"))
    across = Mesh((size, n // size), ("tp", "dp"))
    gloo = dist.new_group(backend="gloo")

    def model():
        torch.manual_seed(0)
        return train_gpt.GPT(args.vocab, args.dim, args.heads, args.layers)

    runs = {}
    for v in names:
        net = model()
        if v in ("ours", "ours-across"):
            tpc = (mesh if v == "ours" else across).comm("tp")
            tp.parallelize(net, tpc, train_gpt.plan(net, args.sequence_parallel))

            def loss_fn(logits, y, tpc=tpc):
                return tp.vocab_parallel_cross_entropy(logits, y, tpc)
        else:
            group = gloo if v == "dtensor-gloo" else mesh.group("tp")
            _dtensor(net, DeviceMesh.from_group(group, "cpu"))

            def loss_fn(logits, y):
                from torch.distributed.tensor.parallel import loss_parallel
                with loss_parallel():
                    loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
                    loss.backward()
                return loss
        opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
        runs[v] = (net, opt, loss_fn, [], [])
    text = train_gpt.corpus(1 << 20)
    x, y = train_gpt.batch(text, 0, args.batch, args.seq, 0)

    def step(v):
        net, opt, loss_fn, _, losses = runs[v]
        loss = loss_fn(net(x), y)
        if v in ("ours", "ours-across"):
            loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach().full_tensor() if hasattr(loss, "full_tensor")
                            else loss.detach()))

    from bench.cluster import link_bytes
    from collectives.topology import topology
    topo = topology(comm)
    leader = topo.local_rank(comm.Get_rank()) == 0 and not topo.single_node
    wire = {}
    for v in names:  # warm-up: optimizer state, first-call costs
        step(v)
        comm.Barrier()
        before = link_bytes() if leader else None
        step(v)  # the bytes one step sends over its host's link
        comm.Barrier()
        after = link_bytes() if leader else None
        sent = after[0] - before[0] if after and before else -1
        wire[v] = comm.allreduce(sent, op=MPI.MAX)
    for _ in range(args.rounds):
        for v in names:
            for _ in range(args.steps):
                comm.Barrier()
                t0 = time.perf_counter()
                step(v)
                runs[v][3].append(comm.allreduce(time.perf_counter() - t0, op=MPI.MAX))
    if comm.Get_rank() == 0:
        base = statistics.median(runs["dtensor-gloo"][3]) if "dtensor-gloo" in runs else None
        params = sum(q.numel() for q in model().parameters())
        print(f"# bench tp: n={n} (tp={size}), GPT dim {args.dim}, {args.heads} heads, "
              f"{args.layers} layers, vocab {args.vocab}, {params / 1e6:.2f}M parameters, "
              f"batch {args.batch} x seq {args.seq}, AdamW fp32, {args.rounds} rounds x "
              f"{args.steps} steps, medians; ours "
              f"{'with' if args.sequence_parallel else 'without'} sequence parallelism")
        show = any(b >= 0 for b in wire.values())
        print(f"{'variant':<14} {'step ms':>9} {'spread':>7} {'x gloo':>7} {'loss0':>8}"
              + (f" {'link MB/step':>13}" if show else ""))
        for v in names:
            times, losses = runs[v][3], runs[v][4]
            t = statistics.median(times)
            ratio = f"{t / base:.2f}" if base else "-"
            print(f"{v:<14} {t * 1e3:9.1f} {spread(times):7.2f} {ratio:>7} {losses[0]:8.4f}"
                  + (f" {wire[v] / 1e6:13.2f}" if show else ""))
        if show:
            print("# link MB/step: bytes one step sent over the busiest host's eth0 (the "
                  "kernel's counter)")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
