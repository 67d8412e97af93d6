"""DDP step time: ours against torch's DDP over gloo, ours without overlap, and no communication.

    mpiexec -n 2 python -m bench ddp                 # via the bench dispatcher
    mpiexec -n 2 python -m bench.ddp --rounds 8      # standalone

One training step (``zero_grad``, forward, backward, ``optimizer.step``) of an MLP of about 25M
parameters, batch 32 per rank, one torch thread per rank, for each variant (``--model gpt``: the
GPT of ``examples/train_gpt.py``, ``--layers`` blocks of width ``--dim``, its gradient bytes
spread over many tensors, on random token windows of ``--seq`` tokens):

- ``ours``: ``collectives.torch.DistributedDataParallel`` (buckets allreduced while backward
  runs; on one node its buckets are registered buffers, reduced one-pass);
- ``ours_ordinary``: the same with ``registered_buckets=False``: buckets in ordinary memory,
  reduced by ``auto``'s message-passing pick;
- ``ours_nothread``: the same with ``COLLECTIVES_PROGRESS_THREAD=0`` during its steps: no
  progress thread, the bytes move when DDP's gradient hooks poll and in the end-of-backward
  wait (for machines without a spare core per rank);
- ``ours_step``: ``ours`` with the optimizer stepped inside backward, bucket by bucket as
  each bucket's average arrives (``DistributedDataParallel.optimizer_in_backward``), so the
  step overlaps the buckets still on the wire;
- ``gloo``: ``torch.nn.parallel.DistributedDataParallel`` over torch's gloo backend (file
  store, ranks from MPI);
- ``no_overlap``: the same model with its gradients in one flat buffer, averaged by one
  ``collectives.torch.all_reduce`` after backward (what overlap buys); its backward and
  allreduce times are printed too (whether the communication takes at least the backward's
  time);
- ``single``: every rank steps its own model, no communication (the floor);
- ``ours_timeline`` (not run by default): ``ours`` with the timeline recording
  (``COLLECTIVES_TIMELINE``'s events, kept in memory; the file is written at exit): its cost;
- ``torch_ours`` (not run by default): torch's own DDP over the ``collectives`` backend
  (``collectives.torch.backend``): torch's C++ Reducer, our allreduce.

``--link`` (on the one-machine cluster of ``python -m bench cluster``, whose hosts share one
clock): where the steps of ``ours`` and ``ours_step`` go. The first rank of each host samples
its link's byte counters (``bench.cluster.link_bytes``) every 2 ms while they are timed, and
the table gives, in ms from the step's start (medians over the timed steps): the end of the
forward (the slowest rank), the first bucket's launch (the first rank), the first and last 10
ms in which a host's link carried at least half its busiest 10 ms in either direction, the
idle 10 ms slices between them, the end of backward (every bucket reduced; for
``ours_step`` also stepped) and the step's end.

Variants run interleaved in rounds within the same job, so load on the machine hits all of
them alike; a step's time is the slowest rank's, and the table shows medians, each variant's
ratio to gloo and to ``single``, and for ``ours`` the fraction of the communication span that
was hidden behind backward (``DistributedDataParallel.stats``). ``cpu ms`` is the CPU time of
the slowest rank's process (all its threads) per step: the work behind a step, which on a
machine with as many cores as ranks is what the step time converges to, and which load from
other jobs disturbs less than wall time.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

__all__ = ["main", "mlp", "VARIANTS"]

VARIANTS = ("ours", "ours_ordinary", "ours_nothread", "ours_step", "gloo", "no_overlap",
            "single", "torch_ours", "ours_timeline")
DEFAULT_VARIANTS = ("ours", "ours_ordinary", "ours_nothread", "gloo", "no_overlap", "single")
_OURS = ("ours", "ours_ordinary", "ours_nothread", "ours_step", "ours_timeline")
_LINKED = ("ours", "ours_step")   # --link samples their steps


def mlp(params_m: float = 25.0, width: int = 2048, io: int = 1024):
    """An MLP io -> width x k -> io with about ``params_m`` million parameters."""
    from torch import nn
    per_hidden = width * width + width
    fixed = io * width + width + width * io + io
    hidden = max(0, round((params_m * 1e6 - fixed) / per_hidden))
    layers = [nn.Linear(io, width), nn.ReLU()]
    for _ in range(hidden):
        layers += [nn.Linear(width, width), nn.ReLU()]
    layers.append(nn.Linear(width, io))
    return nn.Sequential(*layers)


def _parser():
    p = argparse.ArgumentParser(prog="python -m bench ddp", description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=("mlp", "gpt"), default="mlp",
                   help="mlp (--params, --width) or the GPT of examples/train_gpt.py (--dim, "
                        "--heads, --layers, --seq) (mlp)")
    p.add_argument("--params", type=float, default=25.0, help="mlp: size, millions (25)")
    p.add_argument("--width", type=int, default=2048, help="mlp: hidden width (2048)")
    p.add_argument("--dim", type=int, default=256, help="gpt: model width (256)")
    p.add_argument("--heads", type=int, default=4, help="gpt: attention heads (4)")
    p.add_argument("--layers", type=int, default=8, help="gpt: blocks (8)")
    p.add_argument("--seq", type=int, default=64, help="gpt: tokens per window (64)")
    p.add_argument("--batch", type=int, default=32,
                   help="samples (gpt: windows) per rank and step (32)")
    p.add_argument("--rounds", type=int, default=6, help="interleaved rounds (6)")
    p.add_argument("--steps", type=int, default=3, help="timed steps per variant and round (3)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per variant (2)")
    p.add_argument("--variants", default=",".join(DEFAULT_VARIANTS),
                   help=f"comma-separated subset of {','.join(VARIANTS)}")
    p.add_argument("--bucket-cap-mb", type=float, default=25.0, help="our DDP's bucket cap (25)")
    p.add_argument("--algorithm", default="auto", help="our allreduce algorithm (auto)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank (1)")
    p.add_argument("--zero-grad", choices=("none", "zeros"), default="none",
                   help="optimizer.zero_grad(set_to_none=...): 'none' (torch's default) frees "
                        "the gradients each step, 'zeros' zeroes them in place")
    p.add_argument("--link", action="store_true",
                   help="ours, ours_step: where each step goes by the hosts' link counters (on "
                        "python -m bench cluster; see the module doc)")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    return p


class _LinkSampler:
    """``(time, sent, received)`` of this host's link every ``period`` s, in a thread."""

    def __init__(self, period: float = 0.002):
        import threading
        from bench.cluster import link_bytes
        self.read, self.period = link_bytes, period
        self.rows: list = []
        self.on = False
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def _loop(self):
        while not self.stop.wait(self.period):
            if self.on:
                now = self.read()
                if now is not None:
                    self.rows.append((time.perf_counter(), *now))

    def close(self) -> list:
        self.stop.set()
        self.thread.join()
        return self.rows


def link_breakdown(marks, hosts, bin_s: float = 0.01) -> dict:
    """Medians over steps of where a step goes (ms from its start; see the module doc).
    ``marks``: per step ``(start, forward_done, first_launch, reduced, end)`` in seconds;
    ``hosts``: each host's ``(time, sent, received)`` samples."""
    from bisect import bisect_left, bisect_right

    def rate(rows, times, t0, t1):
        """Bytes per second in [t0, t1) from the samples around it (either direction, the
        larger)."""
        i, j = bisect_right(times, t0) - 1, bisect_left(times, t1)
        if i < 0 or j >= len(rows):
            return 0.0
        a, b = rows[i], rows[j]
        return max(b[1] - a[1], b[2] - a[2]) / max(b[0] - a[0], 1e-9)

    fields = {k: [] for k in ("forward", "first launch", "link busy from", "link busy to",
                              "link idle inside", "reduced", "step")}
    slices = []
    stamps = [[r[0] for r in rows] for rows in hosts]
    for start, fwd, first, reduced, end in marks:
        n = int((end - start) / bin_s) + 1
        slices.append([[rate(rows, times, start + k * bin_s, start + (k + 1) * bin_s)
                        for k in range(n)] for rows, times in zip(hosts, stamps)])
    full = max((x for step in slices for host in step for x in host), default=0.0)
    for (start, fwd, first, reduced, end), step in zip(marks, slices):
        busy = [k for k in range(len(step[0])) if any(h[k] >= full / 2 for h in step)]
        if not busy:
            continue
        idle = sum(1 for k in range(busy[0], busy[-1] + 1)
                   if any(h[k] < full / 2 for h in step))
        for key, value in (("forward", fwd - start), ("first launch", first - start),
                           ("link busy from", busy[0] * bin_s),
                           ("link busy to", (busy[-1] + 1) * bin_s),
                           ("link idle inside", idle * bin_s),
                           ("reduced", reduced - start), ("step", end - start)):
            fields[key].append(1e3 * value)
    return {k: statistics.median(v) for k, v in fields.items() if v}


class _Flat:
    """``no_overlap``: gradients as views of one flat buffer, one allreduce after backward."""

    def __init__(self, module, comm, algorithm):
        import torch
        self.module, self.comm, self.algorithm = module, comm, algorithm
        params = list(module.parameters())
        self.flat = torch.zeros(sum(p.numel() for p in params))
        offset = 0
        self.views = []
        for p in params:
            self.views.append((p, self.flat[offset:offset + p.numel()].view(p.shape)))
            offset += p.numel()
        self.size = comm.Get_size()

    def reduce(self):
        from collectives.torch import all_reduce
        for p, v in self.views:
            if p.grad is not v:
                v.copy_(p.grad)
                p.grad = v
        self.flat.div_(self.size)
        all_reduce(self.flat, comm=self.comm, algorithm=self.algorithm)


def _gloo(comm):
    """torch.distributed over gloo, rendezvous through a file that rank 0 names."""
    import torch.distributed as dist
    path = None
    if comm.Get_rank() == 0:
        path = os.path.join(tempfile.mkdtemp(prefix="bench-ddp-"), "store")
    path = comm.bcast(path, root=0)
    hook = sys.excepthook  # kept: see bench.gloo.init
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=comm.Get_rank(),
                            world_size=comm.Get_size())
    sys.excepthook = hook
    return path


def main(argv=None) -> int:
    """Run the benchmark under mpiexec; rank 0 prints the table."""
    args = _parser().parse_args(argv)
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        raise SystemExit(f"unknown variants {unknown}; expected a subset of {VARIANTS}")
    import torch
    from mpi4py import MPI
    from torch import nn

    from collectives import config, timeline
    from collectives.torch import DistributedDataParallel
    from bench.report import check_outputs
    torch.set_num_threads(args.threads)
    comm = MPI.COMM_WORLD
    check_outputs(comm, {"--json": args.json})
    rank, size = comm.Get_rank(), comm.Get_size()

    vocab = 264   # examples/train_gpt.py's byte vocabulary
    if args.model == "gpt":
        from bench.tp import train_gpt_module
        gpt = train_gpt_module().GPT

    def build():
        torch.manual_seed(0)
        if args.model == "gpt":
            return gpt(vocab, args.dim, args.heads, args.layers)
        return mlp(args.params, args.width)

    models, store = {}, None
    for v in variants:
        m = build()
        if v in _OURS:
            traced = timeline.on
            timeline.on = traced or v == "ours_timeline"  # registers the optimizer spans
            m = DistributedDataParallel(m, bucket_cap_mb=args.bucket_cap_mb,
                                        algorithm=args.algorithm,
                                        registered_buckets="auto" if v != "ours_ordinary"
                                        else False)
            timeline.on = traced
        elif v == "gloo":
            store = _gloo(comm)
            m = nn.parallel.DistributedDataParallel(m)
        elif v == "torch_ours":
            from collectives.torch.backend import ProcessGroupCollectives
            m = nn.parallel.DistributedDataParallel(
                m, process_group=ProcessGroupCollectives(comm, args.algorithm))
        models[v] = m
    flat = _Flat(models["no_overlap"], comm, args.algorithm) if "no_overlap" in models \
        else None
    opts = {v: torch.optim.SGD(m.parameters(), lr=1e-4) for v, m in models.items()}
    if "ours_step" in models:
        models["ours_step"].optimizer_in_backward(opts["ours_step"])
    phases = {"backward": [], "allreduce": []}   # no_overlap's, while timing
    n_params = sum(p.numel() for p in build().parameters())
    gen = torch.Generator().manual_seed(rank)
    if args.model == "gpt":
        x = torch.randint(0, vocab, (args.batch, args.seq), generator=gen)
        y = torch.randint(0, vocab, (args.batch, args.seq), generator=gen)

        def loss_fn(out, target):
            return nn.functional.cross_entropy(out.reshape(-1, vocab), target.reshape(-1))
    else:
        x = torch.randn(args.batch, 1024, generator=gen)
        y = torch.randn(args.batch, 1024, generator=gen)
        loss_fn = nn.functional.mse_loss

    def step(v):
        # The toolkit reads COLLECTIVES_PROGRESS_THREAD as each collective starts.
        config.set("COLLECTIVES_PROGRESS_THREAD", False if v == "ours_nothread" else thread)
        timeline.on = traced_before or v == "ours_timeline"
        start = time.perf_counter()
        opts[v].zero_grad(set_to_none=args.zero_grad == "none")
        loss = loss_fn(models[v](x), y)
        t0 = time.perf_counter()
        loss.backward()
        if timing and args.link and v in _LINKED:
            done = time.perf_counter()
            if v == "ours":
                opts[v].step()
            marks[v].append((start, t0, models[v].stats.last_start, done, time.perf_counter()))
            return
        if v == "no_overlap":
            t1 = time.perf_counter()
            flat.reduce()
            if timing:
                phases["backward"].append(t1 - t0)
                phases["allreduce"].append(time.perf_counter() - t1)
        if v != "ours_step":  # stepped inside backward
            opts[v].step()

    # ``ours`` runs with the thread unless the setting says otherwise (auto: on).
    before = config.get("COLLECTIVES_PROGRESS_THREAD")
    traced_before = timeline.on
    timing = False
    thread = True if before is None else before

    times = {v: [] for v in variants}
    cpu = {v: [] for v in variants}  # process CPU time (all threads), the work behind a step
    # --link: the steps of each variant in _LINKED, (start, forward done, first launch,
    # reduced, end)
    marks = {v: [] for v in _LINKED if v in models}
    sampler = None
    if args.link and marks:
        host = comm.Split_type(MPI.COMM_TYPE_SHARED)
        if host.Get_rank() == 0:
            sampler = _LinkSampler()
        host.Free()
        sampler_on = comm.allreduce(int(sampler is not None))
    for v in variants:
        for _ in range(args.warmup):
            step(v)
    for v in _OURS:
        if v in models:
            models[v].stats.reset()
    timing = True
    for _ in range(args.rounds):
        for v in variants:
            for _ in range(args.steps):
                comm.Barrier()
                if sampler is not None:
                    sampler.on = v in marks
                c0, t0 = time.process_time(), time.perf_counter()
                step(v)
                dt = time.perf_counter() - t0
                dc = time.process_time() - c0
                times[v].append(comm.allreduce(dt, op=MPI.MAX))
                cpu[v].append(comm.allreduce(dc, op=MPI.MAX))
    timing = False
    link = {}
    if args.link and marks:
        rows = sampler.close() if sampler is not None else None
        every = comm.gather(marks, root=0)
        hosts = [r for r in comm.gather(rows, root=0) or () if r]
        if rank == 0 and sampler_on and hosts:
            for v in marks:
                # per step: the earliest start, the slowest forward, the first launch, the last
                # reduction and end over the ranks
                steps = [(min(m[0] for m in ms), max(m[1] for m in ms), min(m[2] for m in ms),
                          max(m[3] for m in ms), max(m[4] for m in ms))
                         for ms in zip(*(e[v] for e in every))]
                link[v] = link_breakdown(steps, hosts)
    hidden = {v: comm.allreduce(models[v].stats.hidden_fraction(), op=MPI.MIN)
              for v in _OURS if v in models}
    # Every variant ran the same steps on the same data from the same start: the DDP ones
    # must hold the same parameters (the largest difference to ``ours``, over ranks).
    same = {}
    if "ours" in models:
        mine = [p.detach() for p in models["ours"].parameters()]
        for v in models:
            if v not in ("ours", "single", "no_overlap"):
                diff = max(float((a - b.detach()).abs().max())
                           for a, b in zip(mine, models[v].parameters()))
                same[v] = comm.allreduce(diff, op=MPI.MAX)
    config.set("COLLECTIVES_PROGRESS_THREAD", before)
    timeline.on = traced_before

    shape = (f"GPT of {args.layers} blocks, width {args.dim}, {args.seq}-token windows"
             if args.model == "gpt" else "MLP")
    result = {"ranks": size, "params": n_params, "model": shape, "batch": args.batch,
              "threads": args.threads,
              "bucket_cap_mb": args.bucket_cap_mb, "algorithm": args.algorithm,
              "zero_grad": args.zero_grad, "steps": args.steps,
              "median_ms": {v: 1e3 * statistics.median(t) for v, t in times.items()},
              "median_cpu_ms": {v: 1e3 * statistics.median(t) for v, t in cpu.items()},
              "all_ms": {v: [round(1e3 * s, 2) for s in t] for v, t in times.items()},
              "hidden_fraction": hidden,
              "phases_ms": {k: 1e3 * statistics.median(t) for k, t in phases.items() if t},
              "link_ms": link,
              "max_param_diff_to_ours": same}
    if rank == 0:
        _print(result)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1)
    if store is not None:
        import torch.distributed as dist
        dist.destroy_process_group()
    return 0


def _print(r) -> None:
    med = r["median_ms"]
    print(f"# DDP step: {r['params'] / 1e6:.1f}M-parameter {r['model']}, batch {r['batch']} "
          f"per rank, "
          f"{r['ranks']} ranks, {r['threads']} thread(s) per rank, bucket cap "
          f"{r['bucket_cap_mb']:g} MB, algorithm {r['algorithm']}, zero_grad to "
          f"{r['zero_grad']}")
    print(f"# {'variant':<20} {'median ms':>10} {'vs gloo':>8} {'vs single':>10} "
          f"{'cpu ms':>8}  steps (ms)")
    for v, m in med.items():
        vs_gloo = f"{m / med['gloo']:.2f}x" if "gloo" in med else "-"
        vs_single = f"{m / med['single']:.2f}x" if "single" in med else "-"
        runs = " ".join(f"{t:.0f}" for t in r["all_ms"][v])
        print(f"  {v:<20} {m:>10.1f} {vs_gloo:>8} {vs_single:>10} "
              f"{r['median_cpu_ms'][v]:>8.1f}  {runs}")
    for v, h in r["hidden_fraction"].items():
        print(f"# {v}: {100 * h:.0f}% of the gradient communication span hidden behind "
              f"backward")
    for v, d in r["max_param_diff_to_ours"].items():
        print(f"# parameters after the run (the same steps for every variant): {v} vs ours, "
              f"largest difference {d:.3g}")
    if "ours_ordinary" in med and "ours" in med:
        print(f"# registered buckets: ours / ours_ordinary = "
              f"{med['ours'] / med['ours_ordinary']:.2f}")
    if "no_overlap" in med and "ours" in med:
        print(f"# overlap gain: no_overlap - ours = {med['no_overlap'] - med['ours']:.1f} ms "
              f"per step")
    if r["phases_ms"]:
        ph = r["phases_ms"]
        print(f"# no_overlap: backward {ph['backward']:.1f} ms, allreduce of every gradient "
              f"after it {ph['allreduce']:.1f} ms (communication / backward = "
              f"{ph['allreduce'] / ph['backward']:.2f})")
    for v, link in r.get("link_ms", {}).items():
        print(f"# {v}, where a step goes (ms from its start, medians): " + ", ".join(
            f"{k} {ms:.0f}" for k, ms in link.items()))
    if "ours_timeline" in med and "ours" in med:
        print(f"# timeline overhead: ours_timeline / ours = "
              f"{med['ours_timeline'] / med['ours']:.3f} (wall), "
              f"{r['median_cpu_ms']['ours_timeline'] / r['median_cpu_ms']['ours']:.3f} (cpu)")
    sys.stdout.flush()


if __name__ == "__main__":
    raise SystemExit(main())
