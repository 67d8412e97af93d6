"""A recommendation-style model on the parameter server: sparse embeddings on server ranks,
the dense MLP on the workers' allreduce (the hybrid), or everything on allreduce.

    mpiexec -n 4 python examples/train_ps.py                       # 1 server + 3 workers
    mpiexec -n 4 python examples/train_ps.py --staleness 3 --straggle 0.2 --slowdown 4 \\
        --dense server                                             # the straggler study's run
    mpiexec -n 3 python examples/train_ps.py --mode allreduce --steps 10   # DDP's way

The model: each sample is a bag of ``--bag`` ids drawn from a Zipf law over ``--ids`` ids
(default 1M); their ``--dim``-wide embeddings (default 32) are averaged and fed to an MLP
(dim -> 64 -> 1, ReLU); the loss is half the squared error against a target that is the bag's
mean of a fixed hidden value per id (a hash of the id), so the model has to learn a value per
id, and rare ids stay hard. Forward and backward are numpy.

- ``--mode ps`` (default): the embedding table is a sparse table on the ``--servers`` last
  ranks (Adagrad on the servers); each step pulls the batch's rows and pushes their gradients.
  The MLP's gradient is averaged among the workers with ``collectives.allreduce(op="avg",
  comm=job.workers)`` (``--dense allreduce``), or the MLP is a dense table on the servers too
  (``--dense server``), so that the staleness bound governs the whole model: the allreduce
  makes the workers meet every step, whatever the staleness.
- ``--mode allreduce``: every rank is a worker holding the whole table, whose full gradient
  (``ids x dim``) is averaged with the toolkit's allreduce every step, as DDP alone would.

Every worker pushes its gradient divided by the number of workers, so that under BSP (the
servers sum one clock's pushes) a step is synchronous data-parallel training on the mean
gradient. ``--compute S`` is the step's simulated compute (a sleep, so that on a shared or
oversubscribed machine the stragglers' sleeps, not CPU contention, set the pace);
``--straggle P --slowdown F`` makes each worker, at each step, with probability P, take F
times as long; ``--straggler RANK`` makes that worker always F times slower.

The last line printed is a JSON summary: mode, servers, workers, staleness, steps, final_loss
(on a fixed evaluation set, after every push), wall_s, time_to_target_s (when the mean
training loss over the last 20 steps of every worker, in time order, first reaches
``--target-loss``; null if never), bytes_per_step (per worker, both directions: the requests
and replies of the tables, and a ring allreduce's 4 (p-1)/p x bytes for the allreduced part)
and step_s (the median step time of worker 0).
"""
import argparse
import json
import sys
import time

import numpy as np
from mpi4py import MPI

import collectives as coll
from collectives import ps
from collectives.ps.store import initial_rows, mix

HIDDEN = 64


def hidden_value(ids):
    """The fixed value per id that the target averages: uniform in [-1, 1)."""
    u = (mix(ids.astype(np.uint64) + np.uint64(12345)) >> np.uint64(11)).astype(np.float64)
    return 2.0 * u / float(1 << 53) - 1.0


def batch(rng, args):
    """A batch: (batch, bag) Zipf ids and their targets."""
    ids = (rng.zipf(args.zipf, size=(args.batch, args.bag)) - 1) % args.ids
    y = hidden_value(ids).mean(axis=1)
    return ids.astype(np.int64), y.astype(np.float32)


class MLP:
    """dim -> 64 -> 1 with ReLU; parameters in one flat float32 array (one allreduce)."""

    def __init__(self, dim, seed):
        rng = np.random.default_rng(seed)
        self.shapes = [(dim, HIDDEN), (HIDDEN,), (HIDDEN, 1), (1,)]
        sizes = [int(np.prod(s)) for s in self.shapes]
        self.flat = np.zeros(sum(sizes), np.float32)
        self.grad = np.zeros_like(self.flat)
        self.views = self._split(self.flat, sizes)
        self.grads = self._split(self.grad, sizes)
        self.views[0][...] = rng.standard_normal((dim, HIDDEN)) / np.sqrt(dim)
        self.views[2][...] = rng.standard_normal((HIDDEN, 1)) / np.sqrt(HIDDEN)

    def _split(self, flat, sizes):
        out, at = [], 0
        for shape, n in zip(self.shapes, sizes):
            out.append(flat[at:at + n].reshape(shape))
            at += n
        return out

    def loss(self, pooled, y):
        w1, b1, w2, b2 = self.views
        h = np.maximum(pooled @ w1 + b1, 0)
        err = (h @ w2 + b2)[:, 0] - y
        return 0.5 * float(np.mean(err.astype(np.float64) ** 2)), h, err

    def backward(self, pooled, y):
        """Loss, and gradients: of the MLP into self.grad, of the pooled input returned."""
        w1, b1, w2, b2 = self.views
        loss, h, err = self.loss(pooled, y)
        d = (err / len(y))[:, None].astype(np.float32)
        g1, gb1, g2, gb2 = self.grads
        np.matmul(h.T, d, out=g2)
        gb2[...] = d.sum(axis=0)
        dh = (d @ w2.T) * (h > 0)
        np.matmul(pooled.T, dh, out=g1)
        gb1[...] = dh.sum(axis=0)
        return loss, dh @ w1.T


def ring_bytes(nbytes, p):
    """Bytes a rank sends and receives in a ring allreduce of ``nbytes`` over ``p`` ranks."""
    return 4 * (p - 1) * nbytes // p if p > 1 else 0


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mode", choices=("ps", "allreduce"), default="ps")
    ap.add_argument("--dense", choices=("allreduce", "server"), default="allreduce")
    ap.add_argument("--servers", type=int, default=1)
    ap.add_argument("--staleness", default="0", help="an integer, or none (asynchronous)")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ids", type=int, default=1_000_000)
    ap.add_argument("--dim", type=int, default=32)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--bag", type=int, default=8)
    ap.add_argument("--zipf", type=float, default=1.1)
    ap.add_argument("--lr", type=float, default=0.1, help="Adagrad's on the embeddings")
    ap.add_argument("--dense-lr", type=float, default=0.05, help="SGD's on the MLP")
    ap.add_argument("--target-loss", type=float, default=0.0095)
    ap.add_argument("--compute", type=float, default=0.02, help="simulated compute per step, s")
    ap.add_argument("--straggle", type=float, default=0.0)
    ap.add_argument("--slowdown", type=float, default=1.0)
    ap.add_argument("--straggler", type=int, default=None)
    ap.add_argument("--quiet", action="store_true")
    args = ap.parse_args(argv)
    staleness = None if args.staleness.lower() == "none" else int(args.staleness)

    world = MPI.COMM_WORLD
    if args.mode == "ps":
        job = ps.init(world, servers=args.servers)
        if job.is_server:
            job.serve()
            return 0
        comm, index, workers = job.workers, job.rank, job.num_workers
    else:
        job, comm = None, world
        index, workers = world.Get_rank(), world.Get_size()

    mlp = MLP(args.dim, args.seed)
    flat_mlp = mlp.flat.size
    if job is not None:
        emb = job.sparse_table("emb", args.dim, "float32", optimizer="adagrad", lr=args.lr,
                               staleness=staleness, init="uniform", init_scale=0.5,
                               seed=args.seed)
        if args.dense == "server":
            dense = job.dense_table("mlp", (flat_mlp,), "float32", optimizer="sgd",
                                    lr=args.dense_lr, staleness=staleness)
            if index == 0:
                dense.assign(mlp.flat)
            comm.Barrier()
    else:
        table = initial_rows(np.arange(args.ids, dtype=np.int64), args.dim, np.float32,
                             "uniform", 0.5, args.seed)
        accum = np.zeros_like(table)
        full_grad = np.zeros_like(table)
        scratch = np.empty_like(table)

    data_rng = np.random.default_rng([args.seed, index])
    slow_rng = np.random.default_rng([args.seed, index, 1])
    log, steps_s = [], []
    comm.Barrier()
    start = time.perf_counter()
    for step in range(args.steps):
        t0 = time.perf_counter()
        ids, y = batch(data_rng, args)
        flat_ids = ids.reshape(-1)
        if job is not None:
            req = emb.ipull(flat_ids)
            if args.dense == "server":
                mlp.flat[...] = dense.pull()
            rows = req.wait()
        else:
            rows = table[flat_ids]
        t1 = time.perf_counter()     # the step's compute starts when its parameters are in
        pooled = rows.reshape(args.batch, args.bag, args.dim).mean(axis=1)
        loss, dpooled = mlp.backward(pooled, y)
        # Each id of a bag gets the pooled gradient over the bag's length; divided by the
        # number of workers, so that summed pushes make the mean gradient.
        # The simulated compute sits between pull and push, where forward and backward are.
        slow = args.straggler == index or (args.straggle > 0 and
                                           slow_rng.random() < args.straggle)
        nominal = args.compute * (args.slowdown if slow else 1.0)
        spent = time.perf_counter() - t1
        if nominal > spent:
            time.sleep(nominal - spent)
        g_rows = np.repeat(dpooled / (args.bag * workers), args.bag, axis=0).astype(np.float32)
        if job is not None:
            emb.ipush(flat_ids, g_rows)
            if args.dense == "server":
                mlp.grad /= workers
                dense.ipush(mlp.grad)
            else:
                coll.allreduce(mlp.grad, op="avg", out=mlp.grad, comm=comm)
                mlp.flat -= args.dense_lr * mlp.grad
            job.clock()
        else:
            full_grad[...] = 0
            np.add.at(full_grad, flat_ids, g_rows * workers)
            coll.allreduce(full_grad, op="avg", out=full_grad, comm=comm)
            # Adagrad on the whole table, in place (untouched rows have a zero gradient).
            np.multiply(full_grad, full_grad, out=scratch)
            accum += scratch
            np.sqrt(accum, out=scratch)
            scratch += 1e-10
            np.divide(full_grad, scratch, out=scratch)
            scratch *= args.lr
            table -= scratch
            coll.allreduce(mlp.grad, op="avg", out=mlp.grad, comm=comm)
            mlp.flat -= args.dense_lr * mlp.grad
        now = time.perf_counter()
        steps_s.append(now - t0)
        log.append((now - start, loss))
        if not args.quiet and index == 0 and (step % 50 == 0 or step == args.steps - 1):
            print(f"step {step:5d}  loss {loss:.5f}  {now - start:7.2f} s", flush=True)

    if job is not None:
        job.flush()
        comm.Barrier()
        job.clock()     # under BSP, this pull waits for every push to be applied
        if args.dense == "server":
            mlp.flat[...] = dense.pull()
    else:
        comm.Barrier()
    wall = time.perf_counter() - start
    eval_rng = np.random.default_rng([args.seed, 10**6])
    final = []
    for _ in range(8):
        ids, y = batch(eval_rng, args)
        rows = emb.pull(ids.reshape(-1)) if job is not None else table[ids.reshape(-1)]
        final.append(mlp.loss(rows.reshape(args.batch, args.bag, args.dim).mean(axis=1), y)[0])
    final_loss = float(np.mean(final))
    if job is not None:
        moved = job.sent + job.received
        if args.dense == "allreduce":
            moved += args.steps * ring_bytes(mlp.flat.nbytes, workers)
        job.finish()
    else:
        moved = args.steps * (ring_bytes(table.nbytes, workers)
                              + ring_bytes(mlp.flat.nbytes, workers))
    logs = comm.gather(log, root=0)
    bytes_all = comm.gather(moved / args.steps, root=0)
    if index != 0:
        return 0
    merged = sorted(x for log in logs for x in log)
    times = np.array([t for t, _ in merged])
    losses = np.array([v for _, v in merged])
    window = 20 * workers
    to_target = None
    if len(losses) >= window:
        smooth = np.convolve(losses, np.ones(window) / window, mode="valid")
        hit = np.nonzero(smooth <= args.target_loss)[0]
        if len(hit):
            to_target = float(times[hit[0] + window - 1])
    summary = {"mode": args.mode, "dense": args.dense if args.mode == "ps" else "allreduce",
               "servers": args.servers if args.mode == "ps" else 0, "workers": workers,
               "staleness": staleness, "steps": args.steps, "final_loss": round(final_loss, 6),
               "wall_s": round(wall, 3),
               "time_to_target_s": None if to_target is None else round(to_target, 3),
               "target_loss": args.target_loss, "bytes_per_step": int(np.mean(bytes_all)),
               "step_s": round(float(np.median(steps_s)), 5)}
    print(json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
