"""Data-parallel training that survives a dead rank (``collectives.elastic``).

    mpirun --with-ft ulfm --oversubscribe -n 4 python examples/train_elastic.py --kill 2:10
    mpirun --with-ft ulfm --oversubscribe -n 4 python examples/train_elastic.py --kill 2:10 --zero 3
    mpirun --with-ft ulfm --oversubscribe -n 4 python examples/train_elastic.py --kill 1:5,3:9,2:14
    mpirun --with-ft ulfm --oversubscribe -n 4 python examples/train_elastic.py --kill 2:5 --replace
    mpirun --with-ft ulfm --oversubscribe -n 4 python examples/train_elastic.py --kill 2:5 --tp 2
    mpirun --with-ft ulfm --oversubscribe -n 4 python examples/train_elastic.py --kill 2:5 --pp 2
    mpirun --with-ft ulfm --oversubscribe -n 4 python examples/train_elastic.py --kill 2:5 \\
        --torch-ddp
    mpiexec -n 4 python examples/train_elastic.py            # MPICH: no failure survived in-job
    python -m collectives.elastic run --np 4 --min-np 2 -- python examples/train_elastic.py \\
        --checkpoint-dir /tmp/ckpt --checkpoint-every 5 --kill 2:12

``--zero 2`` (or 1, 3) trains with ``ShardedDataParallel`` instead of DDP: its shards and their
optimizer state are committed with a copy on the next rank (``collectives.elastic.zero``), so a
dead rank's shard is rebuilt from its copy. ``--replace`` starts a replacement for every rank
lost (``elastic.run(replace=True)``: spawn and merge; it receives the committed state from rank
0 and the job is back to its size). ``--tp 2`` trains examples/train_gpt.py's GPT (a small one:
``--width``, 4 heads, 2 layers) on a mesh of (ranks / 2) x 2 (dp x tp):
``tensor_parallel.parallelize`` over "tp", DDP over "dp", on an ``elastic.ElasticMesh``, which
drops the dead rank's tp group (its partner leaves; the complete groups go on). Steps draw
``--global-batch`` windows of train_gpt.py's corpus, split over the dp groups. ``--torch-ddp``
trains with torch's own ``DistributedDataParallel`` over the toolkit's backend of
``torch.distributed`` (``collectives.torch.backend``): elastic training rebuilds torch's
default group on the survivors, and the example wraps the model again on it
(``state.on_rebuild``). ``--pp 2`` trains the GPT in 2 pipeline stages (1F1B,
``collectives.torch.pipeline.gpt.PipelinedGPT``) on a (ranks / 2) x 2 (dp x pp) mesh: the
dead rank's pipeline is dropped. Otherwise a small
MLP learns a fixed random teacher network on synthetic data made here (nothing is downloaded).
Every step trains on the same global batch whatever the rank count (``elastic.GlobalBatches``):
the survivors of a failure share it. Rank 0 prints ``step S ranks R loss L`` per step and, at
the end, one JSON line: ``steps``, ``ranks`` at the start and end, ``steps_lost`` (committed
steps given up, summed over recoveries), ``recoveries`` (each with its ``seconds`` from the
error to the restored state and ``since_commit`` from the last commit, which bounds the time the
failure cost), ``path`` (``ulfm``: shrink and go on; ``restart``: a run of the supervisor), the
SHA-256 ``digest`` of the parameters and ``digests_equal`` (every rank computed it; equal on all
of them), ``commit_ms`` and ``step_ms`` (mean per step), and with checkpoints ``checkpoint_ms``
(the mean time the training loop spent per checkpoint); with ``--tp``, ``mesh``
(its shape at the end). A rank that leaves (``--tp``) prints ``rank R left at step S``.

``--kill RANK:STEP,...`` kills the process named RANK (``COMM_WORLD`` rank, or ``W + k`` for the
k-th replacement) with SIGKILL as it starts step STEP (``elastic.FailureInjector``), in a job
that starts from step 0 (not in one that the supervisor restarted from a checkpoint);
``--announce`` makes every rank print ``rank R pid P`` first, for a kill from outside the job.
``--save-restored PATH`` writes, at the first recovery, the state the survivors went back to
(for a reference run; with ``--tp``, every rank's commit by its place in the new mesh: its tp
shards and their optimizer state, or with ``--zero`` its ZeRO parts); ``--resume PATH`` starts
from such a file. ``--tp`` takes ``--zero 1`` or ``2`` (ZeRO over the dp axis) and
``--sequence-parallel``.
"""
import argparse
import gc
import hashlib
import json
import os
import sys
import time

# Open MPI: a rank leaves MPI_Finalize without a fence with every other rank of the job, dead
# ones included (with it, the last survivors of a job that lost ranks may wait there for
# ever). Set before MPI starts; other MPI libraries ignore it. The variable is Open MPI's
# "async_mpi_finalize" (ompi_mpi_params.c registers it under "async", not "mpi").
os.environ.setdefault("OMPI_MCA_async_mpi_finalize", "1")
# One rank a node, as the toolkit's topology sees it: ``auto`` (the tensor-parallel layers'
# choice) then never picks a shared-memory algorithm, whose wait on a dead rank no MPI error
# interrupts (docs/elastic.md). The DDP and ZeRO paths name algorithm="ring" instead.
if "--tp" in sys.argv or "--pp" in sys.argv or "--torch-ddp" in sys.argv:
    os.environ.setdefault("COLLECTIVES_RANKS_PER_NODE", "1")

import torch  # noqa: E402
from mpi4py import MPI  # noqa: E402
from torch import nn  # noqa: E402

import collectives as coll  # noqa: E402
from collectives import elastic  # noqa: E402
from collectives.torch import DistributedDataParallel, ShardedDataParallel  # noqa: E402


def parse():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--global-batch", type=int, default=48)
    p.add_argument("--samples", type=int, default=4800)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kill", default="", help="RANK:STEP,... killed by SIGKILL")
    p.add_argument("--min-ranks", type=int, default=1)
    p.add_argument("--commit-every", type=int, default=1)
    p.add_argument("--checkpoint-dir", default=None)
    p.add_argument("--checkpoint-every", type=int, default=5)
    p.add_argument("--checkpoint-keep", type=int, default=2, help="complete checkpoints kept")
    p.add_argument("--save-restored", default=None)
    p.add_argument("--resume", default=None)
    p.add_argument("--zero", type=int, default=0, choices=(0, 1, 2, 3),
                   help="ZeRO stage (ShardedDataParallel, shards kept redundantly); 0: DDP")
    p.add_argument("--tp", type=int, default=0,
                   help="tensor-parallel size: a GPT on an elastic dp x tp mesh; 0: the MLP")
    p.add_argument("--pp", type=int, default=0,
                   help="pipeline size: the GPT's blocks in stages on an elastic dp x pp mesh "
                        "(1F1B, 2 micro-batches, DDP per stage over dp); 0: no pipeline")
    p.add_argument("--sequence-parallel", action="store_true",
                   help="with --tp: sequence parallelism in the tensor-parallel layers")
    p.add_argument("--torch-ddp", action="store_true",
                   help="torch's own DistributedDataParallel over the collectives backend of "
                        "torch.distributed (its default group rebuilt after a failure)")
    p.add_argument("--replace", action="store_true",
                   help="start a replacement for every rank lost (ULFM: spawn and merge); it "
                        "receives the state from rank 0")
    p.add_argument("--quiet", action="store_true", help="no per-step lines")
    p.add_argument("--announce", action="store_true",
                   help="every rank prints 'rank R pid P' first (to be killed from outside)")
    return p.parse_args()


def make_data(samples, dim=16, seed=0):
    """Inputs and the outputs of a fixed random teacher network (regression)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(samples, dim, generator=g)
    teacher = nn.Sequential(nn.Linear(dim, 32), nn.Tanh(), nn.Linear(32, 4))
    with torch.no_grad():
        for p in teacher.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
        y = teacher(x)
    return x, y


def digest(sd) -> str:
    h = hashlib.sha256()
    for name, p in sorted(sd.items()):
        h.update(name.encode())
        h.update(p.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def main():
    args = parse()
    if args.tp and args.zero == 3:
        raise SystemExit("--tp with --zero: stages 1 and 2 (the digest reads the tp shards)")
    if args.pp and (args.tp or args.zero or args.torch_ddp or args.replace):
        raise SystemExit("--pp goes with none of --tp, --zero, --torch-ddp, --replace")
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    world = MPI.COMM_WORLD
    if args.announce and MPI.Comm.Get_parent() == MPI.COMM_NULL:  # not a replacement
        print(f"rank {world.Get_rank()} pid {os.getpid()}", flush=True)
    emesh = gpt = job = None
    if args.pp:
        import numpy as np
        import train_gpt as gpt   # beside this script
        from collectives.torch.pipeline.gpt import PipelinedGPT
        emesh = elastic.ElasticMesh((world.Get_size() // args.pp, args.pp), ("dp", "pp"))
        text = gpt.corpus(1 << 17)
        job = PipelinedGPT(gpt.GPT(256, args.width, 4, 2), emesh.mesh, schedule="1f1b",
                           microbatches=2, loss_fn=lambda z, t: nn.functional.cross_entropy(
                               z.flatten(0, 1), t.flatten()))
        module = nn.ModuleList([m.module if hasattr(m, "module") else m for m in job.stages])
        model = None
        opt = torch.optim.SGD(job.parameters(), lr=args.lr, momentum=0.9)
    elif args.tp:
        import numpy as np
        import train_gpt as gpt   # beside this script
        from collectives.torch import tensor_parallel as tp
        emesh = elastic.ElasticMesh((world.Get_size() // args.tp, args.tp), ("dp", "tp"))
        text = gpt.corpus(1 << 17)
        module = gpt.GPT(256, args.width, 4, 2)
        tp.parallelize(module, emesh.mesh.comm("tp"), gpt.plan(module, args.sequence_parallel))
        if args.zero:   # ZeRO over dp: stages 1 and 2 keep the tp shards whole for the digest
            model = ShardedDataParallel(module, stage=args.zero, comm=emesh.mesh.comm("dp"),
                                        algorithm="ring", registered_buffers=False)
        else:
            model = DistributedDataParallel(module, comm=emesh.mesh.comm("dp"),
                                            algorithm="ring", registered_buckets=False)
        opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    if emesh:
        def tokens(step):
            """This dp group's rows of step ``step``'s windows (inputs, targets)."""
            xs, ys = gpt.batch(text, step, args.global_batch, 32, args.seed)
            rows = np.array_split(np.arange(args.global_batch), emesh.mesh.size("dp"))
            part = torch.from_numpy(rows[emesh.mesh.coord("dp")])
            return xs[part], ys[part]
    else:
        x, y = make_data(args.samples, seed=args.seed)
        module = nn.Sequential(nn.Linear(16, args.width), nn.Tanh(),
                               nn.Linear(args.width, args.width), nn.Tanh(),
                               nn.Linear(args.width, 4))
        # Point-to-point algorithms only: shared-memory ones wait on memory that a dead rank
        # never writes, which no MPI error interrupts (docs/elastic.md).
        if args.torch_ddp:
            import collectives.torch.backend as cb
            cb.init_process_group(world)
            model = torch.nn.parallel.DistributedDataParallel(module)
        elif args.zero:
            model = ShardedDataParallel(module, stage=args.zero, comm=world, algorithm="ring",
                                        registered_buffers=False)
        else:
            model = DistributedDataParallel(module, comm=world, algorithm="ring",
                                            registered_buckets=False)
        opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    batches = elastic.GlobalBatches(args.samples, args.global_batch, seed=args.seed)
    # With a mesh the State keeps the tensor-parallel module (this rank's shards); the mesh
    # rebuilds the layers' group and DDP over dp after a failure.
    inner = (emesh and not args.zero) or args.torch_ddp   # the State keeps the module
    state = elastic.State(model=module if inner else model, optimizer=opt, step=0)
    if emesh:
        emesh.attach(state, module, model, pipeline=job)
    if args.torch_ddp:
        def rewrap(comm):
            # elastic rebuilt torch's default group on the survivors first; torch's DDP
            # (its Reducer, its hooks on the parameters) is made again on it
            nonlocal model
            model = None
            gc.collect()    # the old Reducer's hooks leave with it
            model = torch.nn.parallel.DistributedDataParallel(module)
        state.on_rebuild(rewrap)
    ckpt = None
    if args.checkpoint_dir:
        from collectives.elastic import checkpoint
        ckpt = checkpoint.Checkpointer(args.checkpoint_dir, every=args.checkpoint_every,
                                       comm=world, keep=args.checkpoint_keep)
        ckpt.attach(state)
        ckpt.load_newest(state)
    if args.resume:
        saved = torch.load(args.resume, weights_only=False)
        if emesh:       # the commit of the rank at this rank's place in the mesh
            mine = saved["mesh"][tuple(emesh.mesh.coord(n) for n in emesh.names)]
            state.load(elastic.Commit(saved["next_step"], mine[0], mine[1], None, {}))
        elif args.zero:
            model.load_full_state_dict(saved["model"])
            model.load_full_optim_state_dict(opt, saved["optimizer"])
            state.step = saved["next_step"]
        else:
            state.load(elastic.Commit(**saved))
    started_at = state.step
    # Failures are injected into a job that starts from step 0 only: a job restarted from a
    # checkpoint (the supervisor's) would otherwise meet them again.
    inject = elastic.FailureInjector.parse(args.kill if started_at == 0 else "")
    timing = {"commit": 0.0, "step": 0.0, "n": 0}
    ranks0 = world.Get_size()

    @elastic.run(state, comm=world, min_ranks=args.min_ranks, replace=args.replace,
                 select=emesh.select if emesh else None,
                 revoke=emesh.revoke if emesh else None)
    def train(state, comm):
        rank, size = comm.Get_rank(), comm.Get_size()
        for state.step in range(state.step, args.steps):
            inject(state.step)
            t0 = time.perf_counter()
            opt.zero_grad()
            if job:         # the pipeline's step runs forward and backward
                xb, yb = tokens(state.step)
                loss = job.step(xb if job.first else None, yb if job.last else None)
            else:
                if emesh:
                    xb, yb = tokens(state.step)
                    loss = tp.vocab_parallel_cross_entropy(model(xb), yb,
                                                           emesh.mesh.comm("tp"))
                else:
                    idx = torch.from_numpy(batches.indices(state.step, rank, size))
                    loss = nn.functional.mse_loss(model(x[idx]), y[idx])
                loss.backward()
            opt.step()
            mean = coll.allreduce(loss.detach().reshape(1), op="avg", comm=comm,
                                  algorithm="ring")
            t1 = time.perf_counter()
            if (state.step + 1) % args.commit_every == 0 or state.step + 1 == args.steps:
                state.commit()
            t2 = time.perf_counter()
            timing["step"] += t1 - t0
            timing["commit"] += t2 - t1
            timing["n"] += 1
            if rank == 0 and not args.quiet:
                print(f"step {state.step} ranks {size} loss {mean.item():.6f}", flush=True)
        return comm

    restored = []

    def save_restored(c):
        # The first restore only: the state that a reference run starts from.
        if restored or (not emesh and os.path.exists(args.save_restored)):
            return
        restored.append(c.next_step)
        if emesh:       # every rank's commit by its place in the new mesh (collective)
            where = tuple(emesh.mesh.coord(n) for n in emesh.names)
            commits = state.comm.gather((where, c.model, c.optimizer), root=0)
            saved = {"next_step": c.next_step,
                     "mesh": {w: (m, o) for w, m, o in commits or ()}}
        elif args.zero:   # whole tensors, gathered from the new shards (collective)
            saved = {"next_step": c.next_step, "model": model.full_state_dict(),
                     "optimizer": model.full_optim_state_dict(opt)}
        else:
            saved = {"next_step": c.next_step, "model": c.model, "optimizer": c.optimizer,
                     "data": c.data, "extra": c.extra}
        if state.comm.Get_rank() == 0:
            torch.save(saved, args.save_restored)

    if args.save_restored:
        state.on_restore(save_restored)

    comm = train()
    if comm is None:    # left: its replica (tp group, pipeline) lost a rank
        print(f"rank {world.Get_rank()} left at step {state.step}", flush=True)
        return
    if ckpt is not None:
        ckpt.close()
    if args.pp:     # every stage's state, from the ranks of this pipeline
        parts = emesh.mesh.comm("pp").allgather(module.state_dict())
        full = {f"stage{k}.{name}": v for k, sd in enumerate(parts) for name, v in sd.items()}
    elif args.tp:
        full = tp.full_state_dict(module, emesh.mesh.comm("tp"))
    else:
        full = model.full_state_dict() if args.zero else module.state_dict()
    mine = digest(full)
    digests = comm.allgather(mine)
    if comm.Get_rank() == 0:
        n = max(1, timing["n"])
        summary = {
            "steps": args.steps, "started_at": started_at, "ranks_start": ranks0,
            "ranks_end": comm.Get_size(),
            "path": "ulfm" if elastic.fault_tolerant(world) else "restart",
            "steps_lost": sum(r.steps_lost for r in state.recoveries),
            "recoveries": [r.as_dict() for r in state.recoveries],
            "digest": mine, "digests_equal": len(set(digests)) == 1,
            "step_ms": round(1e3 * timing["step"] / n, 3),
            "commit_ms": round(1e3 * timing["commit"] / n, 3),
        }
        if emesh is not None:
            summary["mesh"] = list(emesh.mesh.shape)
        if ckpt is not None:
            summary["checkpoint_ms"] = round(1e3 * ckpt.mean_seconds(), 3)
            summary["checkpoints"] = ckpt.written
        print(json.dumps(summary), flush=True)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
