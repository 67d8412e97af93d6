"""A mixture-of-experts layer trained with expert parallelism: tokens travel to their experts
and back by uneven all-to-all.

    mpiexec -n 3 python examples/train_moe.py                # top-1 gating, about 20 s on 2 cores
    mpiexec -n 3 python examples/train_moe.py --top-k 2      # each token to its 2 best experts

The task is made here: each token (a 16-vector) belongs to one of ``2 x ranks`` clusters, and
its target is that cluster's own linear map of it, so one expert per cluster fits it and a
single dense layer cannot. Every rank hosts 2 experts (small MLPs) and a replica of the gate:

1. the gate scores every local token against every expert; each token goes to its top-k
   experts (weights: the softmax scores);
2. dispatch: the rows for each rank's experts are sent there with one uneven all-to-all
   (``collectives.torch.all_to_all_single`` with the split sizes; how many rows come from whom
   is learned with a small all-to-all of the counts first), with the expert index of each row;
3. each rank runs its experts on the rows it received, and a second all-to-all (the splits
   swapped) brings the outputs back, combined with the gate weights;
4. backward runs the two all-to-alls in reverse (an autograd function), so each expert's
   gradient sums the contributions of every rank's tokens; the gate's gradients are averaged
   with ``all_reduce``. An auxiliary load-balancing loss (Switch Transformer's:
   experts x sum over experts of token fraction x mean gate probability) keeps the gate from
   sending everything to a few experts.

Rank 0 prints each epoch's loss (task and auxiliary), the share of tokens each expert got and
the bytes each rank sent per step (all-to-alls both ways, forward and backward, and the gate's
allreduce).
"""
import argparse
import os

os.environ.setdefault("MPIR_CVAR_CH4_PROGRESS_THROTTLE", "1")  # see train_ddp.py

import numpy as np  # noqa: E402
import torch  # noqa: E402
from mpi4py import MPI  # noqa: E402
from torch import nn  # noqa: E402

import collectives as coll  # noqa: E402
from collectives.torch import all_reduce, all_to_all_single  # noqa: E402

DIM = 16


class AllToAll(torch.autograd.Function):
    """Rows of ``x`` to the ranks (``send[j]`` rows to rank j), ``recv[i]`` rows from rank i;
    the gradient goes back the same way, the splits swapped."""

    @staticmethod
    def forward(ctx, x, send, recv):
        ctx.send, ctx.recv = send, recv
        out = x.new_empty((sum(recv),) + tuple(x.shape[1:]))
        all_to_all_single(out, x.contiguous(), recv, send)
        return out

    @staticmethod
    def backward(ctx, grad):
        out = grad.new_empty((sum(ctx.send),) + tuple(grad.shape[1:]))
        all_to_all_single(out, grad.contiguous(), ctx.send, ctx.recv)
        return out, None, None


class MoE(nn.Module):
    """A top-k gated mixture of experts, ``per_rank`` experts hosted on each rank."""

    def __init__(self, ranks, rank, per_rank=2, hidden=32, top_k=1):
        super().__init__()
        self.ranks, self.rank, self.per_rank, self.top_k = ranks, rank, per_rank, top_k
        self.experts_total = ranks * per_rank
        torch.manual_seed(0)  # the gate: the same replica on every rank
        self.gate = nn.Linear(DIM, self.experts_total)
        torch.manual_seed(1 + rank)  # this rank's experts
        self.experts = nn.ModuleList(
            nn.Sequential(nn.Linear(DIM, hidden), nn.ReLU(), nn.Linear(hidden, DIM))
            for _ in range(per_rank))
        self.sent_bytes = 0

    def forward(self, x):
        probs = torch.softmax(self.gate(x), dim=-1)
        weight, expert = probs.topk(self.top_k, dim=-1)             # [tokens, k]
        token = torch.arange(len(x)).repeat_interleave(self.top_k)
        expert, weight = expert.reshape(-1), weight.reshape(-1)
        order = torch.argsort(expert, stable=True)                   # grouped by destination
        token, expert, weight = token[order], expert[order], weight[order]
        dest = expert // self.per_rank
        send = torch.bincount(dest, minlength=self.ranks).tolist()
        recv = coll.alltoall(np.asarray(send, np.int64)).tolist()   # rows from each rank
        rows = AllToAll.apply(x[token], send, recv)
        local = torch.empty(sum(recv), dtype=torch.int64)
        all_to_all_single(local, (expert % self.per_rank).contiguous(), recv, send)
        out = torch.zeros_like(rows)
        for e, mlp in enumerate(self.experts):
            mask = local == e
            out[mask] = mlp(rows[mask])
        back = AllToAll.apply(out, recv, send)
        y = torch.zeros_like(x).index_add(0, token, back * weight[:, None])
        # Switch Transformer's balance loss: fraction of assignments x mean probability
        share = torch.bincount(expert, minlength=self.experts_total).float() / len(expert)
        aux = self.experts_total * (share * probs.mean(0)).sum()
        row = DIM * x.element_size()
        to_others = sum(c for j, c in enumerate(send) if j != self.rank)
        from_others = sum(c for i, c in enumerate(recv) if i != self.rank)
        # forward: rows out, ids out, outputs back; backward: the two data all-to-alls again
        self.sent_bytes = 2 * (to_others + from_others) * row + to_others * 8 + 8 * self.ranks
        return y, aux, share


def make_task(ranks, n, seed):
    """``n`` tokens of ``2 x ranks`` clusters; the target is the cluster's linear map."""
    g = torch.Generator().manual_seed(seed)
    k = 2 * ranks
    centers = torch.randn(k, DIM, generator=torch.Generator().manual_seed(99)) * 3
    maps = torch.randn(k, DIM, DIM, generator=torch.Generator().manual_seed(98)) / DIM ** 0.5
    cluster = torch.randint(k, (n,), generator=g)
    x = centers[cluster] + torch.randn(n, DIM, generator=g)
    y = torch.einsum("nij,nj->ni", maps[cluster], x)
    return x, y


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--epochs", type=int, default=6)
    p.add_argument("--steps", type=int, default=25, help="steps per epoch")
    p.add_argument("--tokens", type=int, default=64, help="tokens per rank per step")
    p.add_argument("--top-k", type=int, default=1, choices=(1, 2))
    p.add_argument("--aux", type=float, default=1.0, help="weight of the balance loss")
    p.add_argument("--lr", type=float, default=3e-3)
    args = p.parse_args()
    torch.set_num_threads(1)
    comm = MPI.COMM_WORLD
    rank, ranks = comm.Get_rank(), comm.Get_size()
    model = MoE(ranks, rank, top_k=args.top_k)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    gate_params = list(model.gate.parameters())
    first = last = None
    for epoch in range(args.epochs):
        losses, auxes, shares, sent = [], [], 0, 0
        for step in range(args.steps):
            x, y = make_task(ranks, args.tokens, seed=(epoch * args.steps + step) * ranks + rank)
            out, aux, share = model(x)
            task = nn.functional.mse_loss(out, y)
            # the mean over every rank's tokens: experts sum their senders' gradients
            ((task + args.aux * aux) / ranks).backward()
            for q in gate_params:  # the replicated gate: gradients summed over ranks
                all_reduce(q.grad)
            opt.step()
            opt.zero_grad()
            losses.append(task.item())
            auxes.append(aux.item())
            shares = shares + share
            sent += model.sent_bytes + sum(q.numel() * 4 for q in gate_params)
        stats = np.array([np.mean(losses), np.mean(auxes), sent / args.steps])
        every = comm.allgather(stats)
        share = coll.allreduce((shares / args.steps).numpy(), op="avg")
        loss = float(np.mean([s[0] for s in every]))
        first = loss if first is None else first
        last = loss
        if rank == 0:
            per_rank = ", ".join(f"{s[2] / 1024:.1f}" for s in every)
            print(f"epoch {epoch}: loss {loss:.4f}, balance loss "
                  f"{np.mean([s[1] for s in every]):.3f}, tokens per expert "
                  f"{' '.join(f'{v:.2f}' for v in share)}, KiB sent per step by each rank "
                  f"[{per_rank}]", flush=True)
    if rank == 0:
        print(f"loss {first:.4f} -> {last:.4f} over {args.epochs} epochs "
              f"({ranks} ranks, {ranks * 2} experts, top-{args.top_k})", flush=True)


if __name__ == "__main__":
    main()
