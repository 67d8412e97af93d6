"""The planner against measurement: every plan of examples/train_gpt.py's GPT on n ranks.

    python -m bench plan                          # 4 ranks, every plan, 3 interleaved rounds
    python -m bench plan --ranks 4 --rounds 5 --json plan.json

It launches its own jobs (``mpiexec -n N``, ``--mpiexec`` to name one), each in fresh processes:

1. *Predict.* ``collectives.plan.search`` lists every plan the example runs on n ranks (dp x tp
   x pp, sequence parallelism, pipeline schedules at ``--microbatches``, ZeRO stage, recompute)
   with its predicted peak memory per rank and step time. Its compute is measured in place,
   on every rank at once, so that the cores are shared as in training (``_probe``): one block
   of the example's model at each micro-batch size, parallelized over its tensor-parallel
   group as training does it (the collectives, whose cost on cores shared by more ranks than
   they have is the scheduler's more than the cost model's, and the recompute included; a
   width's recompute policies timed in turn within each repeat, a recomputed block priced no
   cheaper than the plain one, ``layer_time``), and the tensor-parallel collectives alone;
   then what else the time model asks of the network for the plans, on the plan's own axes,
   every rank at once: the data-parallel and tied-pair collectives, and a pipeline's messages
   as its runner sends them while the ranks around compute; the head and the optimizer by
   ``train_gpt.measured_compute``. The probe runs ``--probe-rounds`` times, one round after
   the other, and the plans are priced with each figure's median over the rounds (load from
   other jobs that comes and goes while it runs then falls on every plan alike, not on the
   blocks that happened to be measured then).
2. *Measure.* The plans run in batches of ``--batch-plans``, one job a batch (a job builds a
   mesh and its communicators per plan, and MPI holds a few thousand at most), each plan for
   ``--steps`` steps after two steps of the same plan at the same widths with one block a
   stage (``train_gpt.warm_up``: code and the libraries' first-use allocations, which depend
   on operand sizes, held before the baseline). Just before and just after a plan's measured
   steps the probe of 1. runs again for that plan, and the mean of the two step times it
   predicts is the round's prediction: the load the measurement saw is the load its
   prediction saw (the machine's cores are shared with other jobs that come and go). Beside
   it, from the same probes, the prediction with the collectives of the other axes than tp and
   the messages at the cost model's idle-machine prices.
   ``--rounds`` rounds run the batches in a rotated order, so that load from other jobs falls
   on all of them alike; ``--only REGEX`` keeps the plans whose name matches.

Measured by the processes themselves: the peak memory, the most any rank's resident set rose
(``VmHWM`` after a reset through ``/proc/self/clear_refs``) above what it held before the plan's
mesh and model were built, with glibc's mmap threshold fixed so that freed tensors leave the
resident set (``collectives.plan.measure``); the step time, the median over the steps after the
first of the slowest rank's step. The table shows the medians over the rounds: memory
predicted / measured; the step as planned (the planner's prediction, by which the rows are
ranked), as predicted in the rounds, as measured, the rounds' spread (interquartile range over
the median) and the median over the rounds of each round's predicted / measured; the summary
the error statistics (with the planned step's beside them) and the planner's first choice
against the fastest plan measured; the last table what recompute keeps and costs for one block.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

__all__ = ["main"]


def _parser():
    p = argparse.ArgumentParser(prog="python -m bench plan", description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch", type=int, default=16, help="sequences per step, global (16)")
    p.add_argument("--vocab", type=int, default=264)
    p.add_argument("--attention", choices=("sdpa", "math"), default="math")
    p.add_argument("--microbatches", type=int, default=4, help="a pipeline's micro-batches (4)")
    p.add_argument("--steps", type=int, default=3, help="steps per plan and round (3)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--probe-rounds", type=int, default=3,
                   help="rounds of the probe the plans are ranked by, per key their median (3)")
    p.add_argument("--batch-plans", type=int, default=10, help="plans per job (10)")
    p.add_argument("--limit", type=int, default=None, help="the first N plans only")
    p.add_argument("--only", default=None, metavar="REGEX",
                   help="the plans whose name matches REGEX only ('pp4', 'tp4 pp1 zero0')")
    p.add_argument("--json", default=None, help="write every row as JSON")
    p.add_argument("--mpiexec", default=None)
    p.add_argument("--job", default=None, help=argparse.SUPPRESS)   # predict:FILE, run:FILE
    p.add_argument("--plans", default=None, help=argparse.SUPPRESS)  # i,j,... with run
    return p


def _flags(args) -> list[str]:
    return ["--dim", str(args.dim), "--heads", str(args.heads), "--layers", str(args.layers),
            "--seq", str(args.seq), "--batch", str(args.batch), "--vocab", str(args.vocab),
            "--attention", args.attention, "--steps", str(args.steps)]


def _job(args) -> int:
    """One MPI job: ``predict:FILE`` writes every plan with its prediction, ``run:FILE`` runs
    the plans ``--plans`` of FILE and appends their measurements to FILE.rows."""
    import torch
    from mpi4py import MPI

    from bench.harness import abort_on_error
    from bench.tp import train_gpt_module
    from collectives import plan as planner
    from collectives.plan import measure
    world = MPI.COMM_WORLD
    abort_on_error(world)
    measure.steady_allocator()
    torch.set_num_threads(1)
    ex = train_gpt_module()
    rank0 = world.Get_rank() == 0
    kind, _, path = args.job.partition(":")
    base = _flags(args)
    if kind == "predict":
        shape = ex.shape(ex.parser().parse_args(base))
        ranks_per_node, cores = ex.node_layout(world)
        net = planner.calibrated(ranks_per_node=ranks_per_node)
        t0 = time.perf_counter()
        # every block the plans run, measured in place first, in one order on every rank
        # (its collectives need every rank of its group; the search's order depends on the
        # times it finds)
        every = list(planner.candidates(shape, world.Get_size(), args.batch, ranks_per_node,
                                        runnable=True, microbatches=args.microbatches))
        probe, compute = _probe(ex, world, {}, net, shape, every, args.probe_rounds)
        plans = planner.search(shape, world.Get_size(), args.batch, None, ranks_per_node,
                               probe, compute, top=None, runnable=True,
                               microbatches=args.microbatches)
        took = time.perf_counter() - t0
        if rank0:
            cost = _recompute_cost(ex, shape, args.batch // world.Get_size())
            with open(path, "w") as f:
                json.dump({"shape": shape.__dict__, "cores": cores, "seconds": took,
                           "plans": [q.to_dict() | {"name": q.name(), "args": q.args()}
                                     for q in plans], "recompute": cost}, f)
        return 0
    with open(path) as f:
        plans = json.load(f)["plans"]
    text = ex.corpus(1 << 20)
    shape = ex.shape(ex.parser().parse_args(base))
    net = planner.calibrated(ranks_per_node=ex.node_layout(world)[0])
    fields = set(planner.Plan.__dataclass_fields__)
    groups: dict = {}
    for i in (int(x) for x in args.plans.split(",")):
        run_args = ex.parser().parse_args(base + plans[i]["args"])
        ex.warm_up(run_args, world, text)
        # the probe: the plan's compute and its tensor-parallel collectives measured again on
        # every rank at once, just before and just after its measured steps, so that its
        # prediction and its measurement see the same load (the mean of the two predictions)
        plan = planner.Plan(**{k: v for k, v in plans[i].items() if k in fields})

        def probed():
            probe, compute = _probe(ex, world, groups, net, shape, [plan])
            # beside it, the same probe with the collectives of other axes than tp and the
            # messages at the cost model's prices: what measuring them in place changes
            idle = _Probed(net, {k: probe.table[k] for k in probe.tp_keys})
            return (planner.step_time(shape, plan, probe, compute)[0],
                    planner.step_time(shape, plan, idle, compute)[0])

        before = probed()
        s = ex.run(run_args, world, text)
        after = probed()
        if rank0:
            with open(path + ".rows", "a") as f:
                f.write(json.dumps({"i": i, "peak_bytes": s["peak_bytes"],
                                    "step_s": s["step_ms"] / 1e3,
                                    "paired_s": (before[0] + after[0]) / 2,
                                    "paired_idle_s": (before[1] + after[1]) / 2,
                                    "loss": s["loss"]}) + "\n")
    return 0


class _Probed:
    """The calibrated network with some collectives and messages measured: ``table`` maps
    (kind, bytes, ranks, stride) to seconds, ``messages`` (bytes, stride, ranks) to seconds;
    the rest are the cost model's."""

    def __init__(self, net, table: dict, messages: dict | None = None):
        self._net, self.table = net, table
        self.messages = {} if messages is None else messages
        self.tp_keys = frozenset(table)   # the block's collectives, measured first

    def __getattr__(self, name):
        return getattr(self._net, name)

    def collective(self, kind: str, nbytes: float, n: int, stride: int):
        secs, sent = self._net.collective(kind, nbytes, n, stride)
        return self.table.get((kind, int(nbytes), n, stride), secs), sent

    def message(self, nbytes: float, stride: int, size: int) -> float:
        secs = self.messages.get((int(nbytes), stride, size))
        return self._net.message(nbytes, stride, size) if secs is None else secs


class _Asked:
    """A network that answers as ``net`` and notes what the time model asks of it: the
    collectives (kind, bytes, ranks, stride) over more than one rank, and the messages
    (bytes, stride, ranks) with the first plan that sent each."""

    def __init__(self, net):
        self._net, self.collectives, self.messages = net, set(), {}
        self.plan = None

    def __getattr__(self, name):
        return getattr(self._net, name)

    def collective(self, kind: str, nbytes: float, n: int, stride: int):
        if n > 1:
            self.collectives.add((kind, int(nbytes), n, stride))
        return self._net.collective(kind, nbytes, n, stride)

    def message(self, nbytes: float, stride: int, size: int) -> float:
        self.messages.setdefault((int(nbytes), stride, size), self.plan)
        return self._net.message(nbytes, stride, size)


class _InSitu:
    """The plan's compute probed as it runs: one block of the example's model, parallelized
    over the plan's tensor-parallel group as training parallelizes it (its collectives and
    recompute included), forward and backward on every rank at once, the median of
    ``repeats``; the tensor-parallel collectives the time model adds to a block are taken off
    again (``net``'s, measured alone), so that the block costs what it cost here. The head and
    the optimizer: ``measured_compute``, measured now."""

    def __init__(self, ex, world, groups: dict, net, repeats: int = 5):
        self._ex, self._world, self._groups, self._net = ex, world, groups, net
        self.repeats = repeats
        self._rest = ex.measured_compute(repeats)
        self._cache: dict = {}

    def layer(self, model, b: int, tp: int, sp: bool, recompute: str):
        """(forward, backward) seconds of one block on one micro-batch, measured in place
        (``measure`` first where the callers' order may differ between ranks)."""
        key = (b, tp, sp, recompute)
        if key not in self._cache:
            self.measure(model, [key])
        return self._cache[key]

    def measure(self, model, keys) -> None:
        """Time the blocks of ``keys`` (micro-batch, tp, sp, recompute), which share one
        micro-batch, tp and sp: each repeat runs every one of them once, so that load from
        other jobs that comes and goes falls on them alike. Collective over the world."""
        import torch

        from collectives.plan import Plan
        from collectives.plan.timing import layer_comm
        from collectives.torch import checkpoint
        from collectives.torch import tensor_parallel as tpar
        keys = [key for key in keys if key not in self._cache]
        if not keys:
            return
        blocks = []
        for b, tp, sp, recompute in keys:
            torch.manual_seed(0)
            gpt = self._ex.GPT(model.vocab, model.dim, model.heads, 1, model.attention)
            if tp > 1:
                tpar.parallelize(gpt, _axis(self._world, self._groups, tp, 1),
                                 self._ex.plan(gpt, sp, recompute))
            elif recompute != "none":
                checkpoint.recompute(gpt, checkpoint.GPT_POLICIES[recompute])
            blocks.append(gpt.blocks[0])
        b, tp, sp, _ = keys[0]
        x = torch.randn(b, model.seq // tp if sp else model.seq, model.dim, requires_grad=True)
        fw, bw = [[] for _ in keys], [[] for _ in keys]
        # one barrier, then every rank computes without a pause, as in training: a block of
        # a few milliseconds timed alone after a barrier runs within a scheduler's time
        # slice, at a core to itself, where ranks outnumber the cores
        self._world.Barrier()
        for _ in range(self.repeats + 1):
            for j, block in enumerate(blocks):
                t0 = time.perf_counter()
                out = block(x)
                t1 = time.perf_counter()
                out.float().pow(2).mean().backward()
                fw[j].append(t1 - t0)
                bw[j].append(time.perf_counter() - t1)
        for j, key in enumerate(keys):
            cf, cb, _ = layer_comm(self._net, model, Plan(1, tp, 1, sp, "1f1b", 1, 1, 0,
                                                           key[3], b))
            self._cache[key] = (max(statistics.median(fw[j][1:]) - cf, 0.0),
                                max(statistics.median(bw[j][1:]) - cb, 0.0))

    def head(self, model, b: int, tp: int, sp: bool):
        """(forward, backward) seconds of the norm, head and loss, measured now."""
        return self._rest.head(model, b, tp, sp)

    def optimizer(self, params: int) -> float:
        """Seconds of one optimizer step, measured now."""
        return self._rest.optimizer(params)


def _probe(ex, world, groups: dict, net, shape, plans, rounds: int = 1) -> tuple:
    """(network, compute) measured now for ``plans``, on every rank at once, each in one sorted
    order: the tensor-parallel collectives of each (micro-batch, tp, sp) they use, each block
    (``_InSitu``), then what else the time model asks of the network for them (``_Asked``):
    the data-parallel and tied-pair collectives on their own axes, and the pipeline's
    messages between neighbouring stages (``_messages``). ``rounds`` > 1: all of it that many
    times, one round after the other, and per key the median over the rounds, so that load
    from other jobs that comes and goes during the probe falls on every plan alike."""
    if rounds > 1:
        found = [_probe(ex, world, groups, net, shape, plans) for _ in range(rounds)]
        nets = [f[0] for f in found]
        probe = _Probed(net, {k: statistics.median(n.table[k] for n in nets)
                              for k in nets[0].table},
                        {k: statistics.median(n.messages[k] for n in nets)
                         for k in nets[0].messages})
        probe.tp_keys = nets[0].tp_keys
        return probe, _Median([f[1] for f in found])
    table: dict = {}
    for b, t, sp in sorted({(q.micro_batch, q.tp, q.sequence_parallel) for q in plans}):
        table.update(_collectives(world, groups, _tp_kinds(shape, t, sp, b)))
    probe = _Probed(net, table)
    compute = _InSitu(ex, world, groups, probe)
    keys = set()
    for q in plans:
        # a recomputed block is priced against the plain one (``layer_time``): both are timed
        keys |= {(q.micro_batch, q.tp, q.sequence_parallel, r) for r in {q.recompute, "none"}}
    for group in sorted({key[:3] for key in keys}):
        compute.measure(shape, sorted(key for key in keys if key[:3] == group))
    from collectives import plan as planner
    asked = _Asked(probe)
    for q in plans:
        asked.plan = q
        planner.step_time(shape, q, asked, compute)
    table.update(_collectives(world, groups, sorted(asked.collectives - set(table))))
    for key in sorted(asked.messages):
        q = asked.messages[key]
        busy = compute.layer(shape, q.micro_batch, q.tp, q.sequence_parallel, "none")[0]
        probe.messages[key] = _messages(world, groups, *key, busy)
    return probe, compute


class _Median:
    """Several probes' compute as one: per question, the median of their answers."""

    def __init__(self, computes: list):
        self._computes = computes

    def layer(self, model, b: int, tp: int, sp: bool, recompute: str):
        """(forward, backward) seconds of one block, the median over the probes."""
        return _medians([c.layer(model, b, tp, sp, recompute) for c in self._computes])

    def head(self, model, b: int, tp: int, sp: bool):
        """(forward, backward) seconds of the norm, head and loss, the median over the probes."""
        return _medians([c.head(model, b, tp, sp) for c in self._computes])

    def optimizer(self, params: int) -> float:
        """Seconds of one optimizer step, the median over the probes."""
        return statistics.median(c.optimizer(params) for c in self._computes)


def _medians(pairs: list) -> tuple:
    return tuple(statistics.median(x) for x in zip(*pairs))


def _axis(world, groups: dict, n: int, stride: int):
    """This rank's communicator along a mesh axis of ``n`` ranks and ``stride`` (the mesh
    lays tp fastest: tp has stride 1, dp tp, pp dp tp), ranks in the axis's order; made once
    (collective over the world) and kept in ``groups``."""
    if (n, stride) not in groups:
        r = world.Get_rank()
        groups[(n, stride)] = world.Split((r // (stride * n)) * stride + r % stride,
                                          (r // stride) % n)
    return groups[(n, stride)]


def _tp_kinds(shape, t: int, sp: bool, b: int) -> list:
    """The collectives a block runs over a tensor-parallel axis of ``t`` on a micro-batch of
    ``b``: its hidden state all-reduced, or all-gathered and reduce-scattered under sequence
    parallelism."""
    if t == 1:
        return []
    nbytes = shape.bytes[3] * b * shape.seq * shape.dim
    return [(kind, nbytes, t, 1) for kind in
            (("allgather", "reduce_scatter") if sp else ("allreduce",))]


def _collectives(world, groups: dict, keys, repeats: int = 7) -> dict:
    """Seconds of each (kind, bytes, ranks, stride) of ``keys``, run on every group of that
    axis at once (``_axis``) as the plan runs it, the median of ``repeats`` after a barrier
    each. ``bytes`` is the full buffer (an all-gather's output)."""
    import numpy as np

    import collectives as coll
    table = {}
    for kind, nbytes, n, stride in keys:
        comm = _axis(world, groups, n, stride)
        x = np.ones(nbytes // 4, dtype=np.float32)
        call = {"allreduce": lambda: coll.allreduce(x, comm=comm),
                "allgather": lambda: coll.allgather(x[:len(x) // n], comm=comm),
                "reduce_scatter": lambda: coll.reduce_scatter(x, comm=comm)}[kind]
        times = []
        for _ in range(repeats + 1):
            world.Barrier()
            t0 = time.perf_counter()
            call()
            times.append(time.perf_counter() - t0)
        table[(kind, nbytes, n, stride)] = statistics.median(times[1:])
    return table


def _messages(world, groups: dict, nbytes: int, stride: int, size: int, busy: float,
              repeats: int = 7) -> float:
    """Seconds of one pipeline message of ``nbytes`` between neighbouring stages, measured as
    the runner sends and receives it (``collectives.p2p``: a send posted, then computing; a
    receive probed in a polling wait) while the ranks around compute as in training: stages
    2k and 2k + 1 of every pipeline at once pass it back and forth, each computing for about
    ``busy`` seconds (a block's forward) after each receive and after each send. A message is
    half of a round trip less the peer's computing between the two (which it reports in the
    reply). Stage 0's median, the same on every rank of the pipeline."""
    import numpy as np

    from collectives import p2p
    comm = _axis(world, groups, size, stride)
    k = comm.Get_rank()
    peer = k + 1 if k % 2 == 0 else k - 1
    x = np.zeros(max(nbytes // 4, 1), dtype=np.float32)
    a = np.ones((64, 64), dtype=np.float32)

    def compute(secs: float) -> float:
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < secs:
            a @ a
        return time.perf_counter() - t0

    def send(tag: int) -> None:
        req = p2p.isend(comm, x, peer, tag)
        compute(busy / 2)   # the next action runs before the send is waited for
        p2p.wait(req.Test, "bench plan: a pipeline message", "its send", comm)

    times = []
    world.Barrier()
    if peer < size:
        for i in range(repeats + 1):
            if k % 2 == 0:
                t0 = time.perf_counter()
                send(i)
                p2p.recv(comm, x, peer, i)
                times.append((time.perf_counter() - t0 - float(x[0])) / 2)
                compute(busy)
            else:
                p2p.recv(comm, x, peer, i)
                x[0] = compute(busy)
                send(i)
    secs = statistics.median(times[1:]) if times else 0.0
    return max(comm.bcast(secs, root=0), 0.0)


def _launch(args, job: str, plans: str | None = None) -> None:
    from bench.launch import mpiexec
    cmd = [mpiexec(args.mpiexec), "-n", str(args.ranks), sys.executable, "-m", "bench", "plan",
           "--job", job] + _flags(args) + ["--microbatches", str(args.microbatches),
                                           "--probe-rounds", str(args.probe_rounds)]
    if plans:
        cmd += ["--plans", plans]
    done = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if done.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stdout[-4000:]}")


def _quartiles(xs):
    if len(xs) < 2:
        return 0.0
    q = statistics.quantiles(xs, n=4)
    return (q[2] - q[0]) / statistics.median(xs)


def main(argv=None) -> int:
    """``python -m bench plan [options]``."""
    args = _parser().parse_args(argv)
    if args.job:
        return _job(args)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "plans.json")
        _launch(args, f"predict:{path}")
        with open(path) as f:
            predicted = json.load(f)
        plans = [q for q in predicted["plans"]
                 if args.only is None or re.search(args.only, q["name"])][:args.limit]
        with open(path, "w") as f:   # the jobs read the plans they run by index
            json.dump(dict(predicted, plans=plans), f)
        shape = predicted["shape"]
        print(f"# bench plan: {len(plans)} plans of a GPT (dim {shape['dim']}, "
              f"{shape['layers']} layers, {shape['heads']} heads, seq {shape['seq']}, "
              f"{shape['attention']} attention, batch {args.batch}) on {args.ranks} ranks "
              f"({predicted['cores']} cores); predicted in {predicted['seconds']:.1f} s; "
              f"{args.rounds} rounds of {args.steps} steps", flush=True)
        k = max(1, args.batch_plans)
        batches = [list(range(i, min(i + k, len(plans)))) for i in range(0, len(plans), k)]
        for r in range(args.rounds):
            shift = (r * len(batches)) // max(args.rounds, 1)
            for batch in batches[shift:] + batches[:shift]:
                _launch(args, f"run:{path}", ",".join(map(str, batch)))
            print(f"# round {r + 1} done", flush=True)
        memory = [[] for _ in plans]
        steps = [[] for _ in plans]
        paired = [[] for _ in plans]
        idle = [[] for _ in plans]
        losses = [None] * len(plans)
        with open(path + ".rows") as f:
            for line in f:
                row = json.loads(line)
                memory[row["i"]].append(row["peak_bytes"])
                steps[row["i"]].append(row["step_s"])
                paired[row["i"]].append(row["paired_s"])
                idle[row["i"]].append(row["paired_idle_s"])
                losses[row["i"]] = row["loss"]
    rows = []
    for q, mem, st, pa, pi, loss in zip(plans, memory, steps, paired, idle, losses):
        m_mem, m_step = statistics.median(mem), statistics.median(st)
        rows.append({"plan": q["name"], "predicted_bytes": q["memory"], "measured_bytes": m_mem,
                     "memory_ratio": q["memory"] / m_mem, "planned_s": q["step_time"],
                     "planned_ratio": q["step_time"] / m_step,
                     "predicted_s": statistics.median(pa), "measured_s": m_step,
                     "step_ratio": statistics.median(p / m for p, m in zip(pa, st)),
                     "idle_ratio": statistics.median(p / m for p, m in zip(pi, st)),
                     "step_spread": _quartiles(st), "loss": loss, "measured_bytes_rounds": mem,
                     "measured_s_rounds": st, "predicted_s_rounds": pa,
                     "predicted_idle_s_rounds": pi})
    print("| plan | predicted MiB | measured MiB | pred/meas | planned ms | predicted ms "
          "| measured ms | spread | pred/meas |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for row in rows:
        print(f"| {row['plan']} | {row['predicted_bytes'] / 2**20:.1f} | "
              f"{row['measured_bytes'] / 2**20:.1f} | {row['memory_ratio']:.3f} | "
              f"{row['planned_s'] * 1e3:.1f} | {row['predicted_s'] * 1e3:.1f} | "
              f"{row['measured_s'] * 1e3:.1f} | {row['step_spread']:.0%} | "
              f"{row['step_ratio']:.2f} |")
    mem_err = [abs(r["memory_ratio"] - 1) for r in rows]
    step_err = [abs(r["step_ratio"] - 1) for r in rows]
    planned_err = [abs(r["planned_ratio"] - 1) for r in rows]
    idle_err = [abs(r["idle_ratio"] - 1) for r in rows]
    first = rows[0]   # the planner's ranking: plans come fastest predicted first
    fastest = min(rows, key=lambda r: r["measured_s"])
    print(f"\nmemory: predicted / measured {min(r['memory_ratio'] for r in rows):.3f} to "
          f"{max(r['memory_ratio'] for r in rows):.3f}, within 10% for "
          f"{sum(e <= 0.10 for e in mem_err)} of {len(rows)}, below 95% of measured for "
          f"{sum(r['memory_ratio'] < 0.95 for r in rows)}")
    print(f"step time, predicted with the compute probed in the same round: |error| median "
          f"{statistics.median(step_err):.0%}, worst {max(step_err):.0%} (median ratio "
          f"{statistics.median(r['step_ratio'] for r in rows):.2f}); as planned (the probe "
          f"before the rounds): median {statistics.median(planned_err):.0%}, worst "
          f"{max(planned_err):.0%}; in the same rounds with the data-parallel and tied-pair "
          f"collectives and the pipeline's messages at the cost model's prices: median "
          f"{statistics.median(idle_err):.0%}, worst {max(idle_err):.0%} (median ratio "
          f"{statistics.median(r['idle_ratio'] for r in rows):.2f})")
    print(f"first choice {first['plan']}: measured {first['measured_s'] * 1e3:.1f} ms; fastest "
          f"measured {fastest['plan']}: {fastest['measured_s'] * 1e3:.1f} ms "
          f"({first['measured_s'] / fastest['measured_s'] - 1:+.0%})")
    cost = predicted["recompute"]
    rows_per = args.batch // args.ranks
    print(f"\nrecompute, one block of {rows_per} sequences (one rank, alone): what autograd "
          f"keeps, forward + backward")
    print("| recompute | saved bytes | of none | forward + backward ms | time vs none |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for pol, (saved, secs) in cost.items():
        print(f"| {pol} | {saved} | {saved / cost['none'][0]:.3f} | {secs * 1e3:.2f} | "
              f"{secs / cost['none'][1] - 1:+.0%} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"shape": shape, "ranks": args.ranks, "rows": rows, "recompute": cost},
                      f, indent=1)
    return 0


def _recompute_cost(ex, shape, rows: int, repeats: int = 9) -> dict:
    """Per recompute policy: (bytes autograd keeps for one block on ``rows`` sequences, the
    median forward + backward seconds)."""
    import torch

    from collectives.torch import checkpoint
    out = {}
    for pol in ("none", "selective", "full"):
        torch.manual_seed(0)
        model = ex.GPT(shape.vocab, shape.dim, shape.heads, 1, shape.attention)
        if pol != "none":
            checkpoint.recompute(model, checkpoint.GPT_POLICIES[pol])
        block = model.blocks[0]
        x = torch.randn(rows, shape.seq, shape.dim, requires_grad=True)
        saved, _ = checkpoint.saved_bytes(lambda: block(x))
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            block(x).square().mean().backward()
            times.append(time.perf_counter() - t0)
        out[pol] = (saved, statistics.median(times[1:]))
    return out
