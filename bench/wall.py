"""``python -m bench wall``: the communication study. Train one model with each way of
communicating, on a rate-limited network, to a target test accuracy.

    python -m bench wall --json wall.json --plot wall.png     # 1 Gbit/s, 3 ranks, 2 rounds
    python -m bench wall --rounds 1 --methods ddp,periodic-8 --stop-at-target
    python -m bench wall --rate none                          # MPI over TCP, no limit
    python -m bench wall --no-network -n 2                    # shared memory, no root needed

It runs without ``mpiexec`` and launches its own jobs: each *round* is one job, ``mpiexec -n N
python -m bench.wall --job ...``, run by ``bench.net.Network(rate)`` in a fresh network
namespace whose loopback is limited to ``--rate`` (MPI over TCP: every rank's bytes cross that
one loopback, so the rate is shared by the job's whole traffic). The job trains every method
once, one after another, in the round's order (the method list rotated by the round's number,
so that a drift in the machine's load, or being first in a fresh job, hits each method alike).
Where ``bench.net.check_available()`` says no (not root, no ``tc``) the command says why and
exits with status 2; ``--no-network`` runs the jobs without a namespace (shared memory).

The model and the data are those of ``examples/train_ddp.py`` (loaded from that file): its CNN
at ``--width`` 128 (1.13M parameters, 4.5 MB of float32 gradients) on 16 x 16 images of six
noisy shapes, ``--batch`` 64 images per rank and step, one torch thread per rank. At 1 Gbit/s
and 3 ranks a ring allreduce of the gradients (4/3 x 4.5 MB sent by each rank, 18 MB in all
through the one loopback) takes 144 ms, about three times a step's compute with 3 ranks on 2
cores (``diloco-32``'s step, which hardly communicates, takes about 45 ms); ``--batch 128``
doubles the compute.
Within a round every method starts from the same model and sees the same batches; round r
seeds both (the initial parameters and the batch order) with r, so that the spread over rounds
holds the training's own variation as well as the machine's (on this model a change of
rounding alone moves the step at which a run first reaches the target by an evaluation or
two). The methods:

- ``ddp``: ``collectives.torch.DistributedDataParallel`` (buckets of ``--bucket-cap-mb``),
  SGD with momentum;
- ``topk``: DDP with ``compression.topk_hook`` (``--ratio`` 0.01), error feedback on, the
  momentum applied by the hook before compressing and SGD without it;
- ``sign``: DDP with ``compression.sign_hook``, error feedback on, at ``--sign-momentum`` 0
  (hook and SGD): with error feedback, sign at momentum 0.9 does not train this model
  (docs/torch.md, "Compression with error feedback");
- ``powersgd``: DDP with ``hooks.powerSGD_hook`` (``--powersgd-rank`` 8, error feedback, plain
  allreduce for the first 10 steps);
- ``periodic-8``: DDP for ``--warmup`` (16) steps, then each rank steps alone and
  ``averaging.Periodic`` averages parameters and buffers every 8 steps (post-local SGD);
- ``hierarchical``: the same warm-up, then ``averaging.Hierarchical({2: pairs, 8: world})``:
  ranks 0 and 1 (and 2 and 3, ...) average every 2 steps, as ranks of one node would, and all
  ranks every 8 (at 3 ranks the third is a node of its own);
- ``diloco-32``: ``averaging.DiLoCo`` on the plain module: inner AdamW (``--inner-lr``) every
  step, an outer Nesterov step (``--outer-lr`` 0.7, momentum 0.9) on the mean pseudo-gradient
  every 32 steps.

The parameter server's hybrid is not among them: it serves sparse embedding rows from server
ranks, and this model has no sparse part.

*Time* is training time: the slowest rank's sum of its steps (forward, backward, optimizer,
averaging), with the
clock stopped while the model is evaluated. *Evaluation*: every ``--eval-every`` steps at which
the ranks hold the same model (every step for the DDP methods; for the averaging methods only
after an averaging round of every rank: every 8 steps, DiLoCo's every 32), on a fixed test set
of ``--test`` images split across the ranks. The ranks' models are compared first (a checksum
of the parameters): a difference is an error, never a silently mixed evaluation. Every run
trains ``--steps`` steps (the same batches for all), so that the final accuracies compare;
the time to target is that of the first evaluation at or above ``--target``.
``--stop-at-target`` ends each run there instead (quicker; its final accuracy is then that of
the crossing). DDP's gradient hooks drive the communication (``--progress-thread auto``: no
progress thread where the ranks fill the cores, the rule of ``examples/train_ddp.py``).

*Bytes*: what each rank handed to collectives per step (the comm hook's or DDP's
``wire_bytes``; an averager's ``payload_bytes``, its warm-up's gradients included), and, on the
network, the loopback's measured bytes per step (``/proc/net/dev`` of the namespace: every
rank's sends, MPI's headers and acknowledgements included).

The table gives per method the median over rounds of the steps and the time to the target (with
the fastest and slowest round), its ratio to ``ddp``'s median, the median final test accuracy,
the median ms per step (training time over steps) and the bytes. ``--json`` writes every run with
its accuracy curve; ``--plot`` draws accuracy against training time (each method's median run).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from bench.launch import mpiexec

__all__ = ["main", "METHODS", "summarise", "plot"]

METHODS = ("ddp", "topk", "sign", "powersgd", "periodic-8", "hierarchical", "diloco-32")
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_EXAMPLE = os.path.join(_ROOT, "examples", "train_ddp.py")
# The options a job takes from the parent (besides --methods, --out, --netns).
_TRAINING = ("target", "steps", "eval_every", "width", "batch", "samples", "test", "lr",
             "momentum", "inner_lr", "outer_lr", "warmup", "ratio", "sign_momentum",
             "powersgd_rank", "bucket_cap_mb", "progress_thread", "stop_at_target")


def _parser():
    p = argparse.ArgumentParser(prog="python -m bench wall", description=__doc__.splitlines()[0])
    p.add_argument("--rate", default="1gbit",
                   help="the loopback's rate, tc syntax (1gbit); none: TCP without a limit")
    p.add_argument("-n", "--ranks", type=int, default=3, help="ranks per job (3)")
    p.add_argument("--methods", default=",".join(METHODS),
                   help=f"comma-separated, from {', '.join(METHODS)} (all)")
    p.add_argument("--rounds", type=int, default=2,
                   help="jobs, each training every method once, in rotated order (2)")
    p.add_argument("--no-network", action="store_true",
                   help="run the jobs without a network namespace (shared memory; no root)")
    p.add_argument("--target", type=float, default=0.95, help="test accuracy to reach (0.95)")
    p.add_argument("--steps", type=int, default=256,
                   help="steps every run trains (256: 4 epochs at 3 ranks)")
    p.add_argument("--stop-at-target", action="store_true",
                   help="end each run at the target instead (quicker; the final accuracy is "
                        "then that of the first evaluation at or above it)")
    p.add_argument("--eval-every", type=int, default=8,
                   help="evaluate every this many steps where the ranks agree (8)")
    p.add_argument("--width", type=int, default=128, help="the CNN's channels (128)")
    p.add_argument("--batch", type=int, default=64, help="images per rank and step (64)")
    p.add_argument("--samples", type=int, default=24576, help="training images (24576)")
    p.add_argument("--test", type=int, default=1024, help="test images (1024)")
    p.add_argument("--lr", type=float, default=0.05,
                   help="SGD's learning rate (0.05: at 0.1 the runs fall back to chance)")
    p.add_argument("--momentum", type=float, default=0.9, help="SGD's momentum (0.9)")
    p.add_argument("--inner-lr", type=float, default=1e-3, help="DiLoCo's AdamW lr (1e-3)")
    p.add_argument("--outer-lr", type=float, default=0.7, help="DiLoCo's outer lr (0.7)")
    p.add_argument("--warmup", type=int, default=16,
                   help="every-step DDP steps before periodic and hierarchical averaging (16)")
    p.add_argument("--ratio", type=float, default=0.01, help="topk: fraction sent (0.01)")
    p.add_argument("--sign-momentum", type=float, default=0.0,
                   help="sign: the hook's momentum (0: with error feedback, sign does not "
                        "train at 0.9 here; docs/torch.md)")
    p.add_argument("--powersgd-rank", type=int, default=8,
                   help="PowerSGD's matrix approximation rank (8)")
    p.add_argument("--bucket-cap-mb", type=float, default=1.0, help="DDP's bucket cap (1.0)")
    p.add_argument("--progress-thread", choices=("auto", "on", "off"), default="auto",
                   help="COLLECTIVES_PROGRESS_THREAD in the jobs (auto: off where the ranks "
                        "have no core to spare, as examples/train_ddp.py)")
    p.add_argument("--mpiexec", default=None,
                   help="launcher (default: the mpiexec beside this Python, else on PATH)")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per job (1800)")
    p.add_argument("--json", metavar="PATH", help="also write every run as JSON")
    p.add_argument("--plot", metavar="PATH", help="draw accuracy against training time (PNG)")
    p.add_argument("--job", action="store_true", help=argparse.SUPPRESS)  # under mpiexec
    p.add_argument("--out", help=argparse.SUPPRESS)                       # the job's result file
    p.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)  # the round's
    p.add_argument("--netns", action="store_true", help=argparse.SUPPRESS)  # lo is the job's own
    return p


def _methods(text: str) -> list[str]:
    names = [m.strip() for m in text.split(",") if m.strip()]
    bad = [m for m in names if m not in METHODS]
    if bad or not names:
        raise SystemExit(f"unknown method(s) {', '.join(bad) or '(none given)'}; "
                         f"expected some of {', '.join(METHODS)}")
    if len(set(names)) != len(names):
        raise SystemExit(f"a method is named twice in {text!r}")
    return names


# -- one job (under mpiexec) ---------------------------------------------------------------------
def _example():
    """examples/train_ddp.py as a module: the study trains what the example trains."""
    spec = importlib.util.spec_from_file_location("_wall_train_ddp", _EXAMPLE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _loopback_bytes() -> int:
    """Bytes sent on ``lo`` so far (this network namespace's, under ``bench.net``)."""
    with open("/proc/net/dev") as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name.strip() == "lo":
                return int(rest.split()[8])
    return 0


class _Method:
    """One method's training objects: what the loop calls and what it reads."""

    __slots__ = ("name", "forward", "module", "opt", "ddp", "avg", "sync_every", "warmup")

    def __init__(self, name, forward, module, opt, ddp=None, avg=None, sync_every=1, warmup=0):
        self.name = name
        self.forward = forward        # what training calls (the DDP, or the module)
        self.module = module          # what evaluation calls
        self.opt = opt                # stepped by the loop; None: the DDP steps it
        self.ddp = ddp
        self.avg = avg
        self.sync_every = sync_every  # after the warm-up, ranks agree every this many steps
        self.warmup = warmup

    def synced(self, step: int) -> bool:
        """Whether every rank holds the same model after ``step`` (counted from 1)."""
        return step <= self.warmup or (step - self.warmup) % self.sync_every == 0

    def evaluates(self, step: int, every: int, cap: int) -> bool:
        """Whether to evaluate after ``step``: every ``every`` steps where the ranks agree
        (counted from the warm-up's end after it), and at the first agreement from ``cap``."""
        if not self.synced(step):
            return False
        since = step if step <= self.warmup else step - self.warmup
        return since % every == 0 or step >= cap

    def step(self) -> None:
        if self.opt is not None:
            self.opt.step()
        if self.avg is not None:
            self.avg.step()

    def payload_bytes(self) -> int:
        if self.avg is not None:
            return self.avg.payload_bytes
        return self.ddp.stats.wire_bytes


def _build(name, args, comm, example):
    """The seeded model of ``name`` with its optimizer, DDP, comm hook or averager."""
    import torch
    from collectives.torch import DistributedDataParallel, averaging, compression, hooks
    torch.manual_seed(args.seed)
    module = example.CNN(args.width)

    def ddp(**kw):
        return DistributedDataParallel(module, comm=comm, bucket_cap_mb=args.bucket_cap_mb, **kw)

    def sgd(params, momentum=args.momentum):
        return torch.optim.SGD(params, lr=args.lr, momentum=momentum)

    if name == "ddp":
        model = ddp()
        return _Method(name, model, module, sgd(model.parameters()), ddp=model)
    if name in ("topk", "sign"):
        # The hook applies the momentum before compressing; SGD runs without it.
        state = compression.TopKState(comm, ratio=args.ratio, momentum=args.momentum) \
            if name == "topk" else compression.SignState(comm, momentum=args.sign_momentum)
        hook = compression.topk_hook if name == "topk" else compression.sign_hook
        model = ddp(comm_hook=(state, hook))
        return _Method(name, model, module, sgd(model.parameters(), 0.0), ddp=model)
    if name == "powersgd":
        state = hooks.PowerSGDState(comm, matrix_approximation_rank=args.powersgd_rank,
                                    start_powerSGD_iter=10)
        model = ddp(comm_hook=(state, hooks.powerSGD_hook))
        return _Method(name, model, module, sgd(model.parameters()), ddp=model)
    if name in ("periodic-8", "hierarchical"):
        model = ddp()
        if name == "periodic-8":
            avg = averaging.Periodic(model, period=8, warmup=args.warmup)
        else:
            pairs = comm.Split(comm.Get_rank() // 2)
            avg = averaging.Hierarchical(model, {2: pairs, 8: None}, warmup=args.warmup)
        return _Method(name, model, module, sgd(model.parameters()), ddp=model, avg=avg,
                       sync_every=8, warmup=args.warmup)
    assert name == "diloco-32", name
    inner = torch.optim.AdamW(module.parameters(), lr=args.inner_lr)
    avg = averaging.DiLoCo(module, inner, outer="nesterov", outer_lr=args.outer_lr, period=32,
                           comm=comm)
    return _Method(name, module, module, inner, avg=avg, sync_every=32)


def _train(name, args, comm, example, data, test) -> dict:
    """Train ``name`` to the target or the cap; rank 0's record of the run."""
    import numpy as np
    import torch
    from mpi4py import MPI
    from torch import nn
    rank, size = comm.Get_rank(), comm.Get_size()
    images, labels = data
    shard = slice(rank * len(test[0]) // size, (rank + 1) * len(test[0]) // size)
    test_x, test_y = test[0][shard], test[1][shard]
    m = _build(name, args, comm, example)
    global_batch = args.batch * size
    per_epoch = len(images) // global_batch
    curve, step, train_s, reached = [], 0, 0.0, None
    lo0 = _loopback_bytes() if args.netns else 0
    comm.Barrier()
    while True:
        epoch, i = divmod(step, per_epoch)
        if i == 0:
            gen = torch.Generator().manual_seed(1000 * args.seed + epoch)
            order = torch.randperm(len(images), generator=gen)
        mine = order[i * global_batch + rank * args.batch:][:args.batch]
        t0 = time.perf_counter()
        if m.opt is not None:
            m.opt.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(m.forward(images[mine]), labels[mine]).backward()
        m.step()
        step += 1
        evaluate = m.evaluates(step, args.eval_every, args.steps)
        train_s += time.perf_counter() - t0
        if not evaluate:
            continue
        # The clock is stopped: the ranks agree on the model, then on the accuracy.
        with torch.no_grad():
            check = float(sum(p.double().square().sum() for p in m.module.parameters()))
            m.module.eval()
            correct = int((m.module(test_x).argmax(1) == test_y).sum())
            m.module.train()
        lo, hi = comm.allreduce(check, op=MPI.MIN), comm.allreduce(check, op=MPI.MAX)
        if hi - lo > 1e-6 * abs(hi):
            raise RuntimeError(f"{name}: the ranks' models differ at step {step} (parameter "
                               f"checksums {lo!r} to {hi!r}); the study evaluates only where "
                               f"they agree")
        counts = np.array([correct, len(test_y)], dtype=np.float64)
        comm.Allreduce(MPI.IN_PLACE, counts, op=MPI.SUM)
        acc = float(counts[0] / counts[1])
        elapsed = comm.allreduce(train_s, op=MPI.MAX)
        curve.append([step, elapsed, acc])
        if acc >= args.target and reached is None:
            reached = (step, elapsed)
        if (reached is not None and args.stop_at_target) or step >= args.steps:
            break
    payload = comm.allreduce(m.payload_bytes(), op=MPI.MAX)
    wire = (_loopback_bytes() - lo0) if args.netns else None
    # rank 0's share of the communication that backward hid
    hidden = m.ddp.stats.hidden_fraction() if m.ddp is not None else None
    del m
    return {"method": name, "steps": step, "train_s": curve[-1][1],
            "reached": reached is not None,
            "steps_to_target": reached[0] if reached else None,
            "time_to_target_s": reached[1] if reached else None,
            "final_accuracy": curve[-1][2], "ms_per_step": 1e3 * curve[-1][1] / step,
            "payload_bytes_per_step": payload / step,
            "loopback_bytes_per_step": None if wire is None else wire / step,
            "hidden": hidden,
            "curve": curve}


def _job(args) -> int:
    """One round under mpiexec: every method of ``--methods`` in order; rank 0 appends one
    JSON line per run to ``--out``."""
    # MPICH: a rank waiting in MPI sleeps instead of spinning (3 ranks share 2 cores here).
    os.environ.setdefault("MPIR_CVAR_CH4_PROGRESS_THROTTLE", "1")
    import torch
    from mpi4py import MPI

    from collectives import config
    example = _example()
    torch.set_num_threads(1)
    comm = MPI.COMM_WORLD
    # No core to spare for a progress thread per rank: DDP's gradient hooks move the bytes
    # (the rule of examples/train_ddp.py).
    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    if args.progress_thread != "auto":
        config.set("COLLECTIVES_PROGRESS_THREAD", args.progress_thread)
    elif config.get("COLLECTIVES_PROGRESS_THREAD") is None and \
            node.Get_size() >= len(os.sched_getaffinity(0)):
        config.set("COLLECTIVES_PROGRESS_THREAD", "off")
    node.Free()
    data = example.make_shapes(args.samples, seed=0)
    test = example.make_shapes(args.test, seed=1)
    # One untimed step of a throwaway DDP first: the job's first method pays no first-call costs.
    warm = argparse.Namespace(**{**vars(args), "steps": 1, "eval_every": 1})
    _train("ddp", warm, comm, example, data, test)
    for name in _methods(args.methods):
        record = _train(name, args, comm, example, data, test)
        if comm.Get_rank() == 0:
            with open(args.out, "a") as f:
                f.write(json.dumps(record) + "\n")
    comm.Barrier()
    return 0


# -- the parent ----------------------------------------------------------------------------------
def _run_round(args, order, seed, out, network, env) -> list[dict]:
    cmd = [mpiexec(args.mpiexec), "-n", str(args.ranks), sys.executable, "-m", "bench.wall",
           "--job", "--methods", ",".join(order), "--out", out, "--seed", str(seed)]
    for name in _TRAINING:
        value = getattr(args, name)
        if value is not False:
            cmd += [f"--{name.replace('_', '-')}"] + ([] if value is True else [str(value)])
    if network is not None:
        done = network.run(cmd + ["--netns"], env=env, timeout=args.timeout, capture=True)
    else:
        done = subprocess.run(cmd, env=env, timeout=args.timeout, capture_output=True,
                              text=True)
    if done.returncode != 0:
        raise SystemExit(f"the job failed (exit {done.returncode}): {' '.join(cmd)}\n"
                         f"{(done.stdout or '')[-3000:]}\n{(done.stderr or '')[-3000:]}")
    with open(out) as f:
        return [json.loads(line) for line in f]


def _median_run(runs: list[dict]) -> dict:
    """The run of median time to target (of the final time where none reached it)."""
    key = [(r["time_to_target_s"] if r["reached"] else float("inf"), r["train_s"]) for r in runs]
    order = sorted(range(len(runs)), key=lambda i: key[i])
    return runs[order[(len(runs) - 1) // 2]]


def summarise(runs: list[dict], methods) -> list[dict]:
    """One row per method over its rounds: medians, the spread, ratios to ddp."""
    rows = []
    for name in methods:
        mine = [r for r in runs if r["method"] == name]
        if not mine:
            continue
        hit = [r for r in mine if r["reached"]]
        times = [r["time_to_target_s"] for r in hit]
        wire = [r["loopback_bytes_per_step"] for r in mine
                if r["loopback_bytes_per_step"] is not None]
        rows.append({
            "method": name, "rounds": len(mine), "reached": len(hit),
            "steps_to_target": statistics.median(r["steps_to_target"] for r in hit)
            if hit else None,
            "time_to_target_s": statistics.median(times) if times else None,
            "time_min_s": min(times) if times else None,
            "time_max_s": max(times) if times else None,
            "final_accuracy": statistics.median(r["final_accuracy"] for r in mine),
            "ms_per_step": statistics.median(r["ms_per_step"] for r in mine),
            "payload_bytes_per_step": statistics.median(r["payload_bytes_per_step"]
                                                        for r in mine),
            "loopback_bytes_per_step": statistics.median(wire) if wire else None})
    base = next((r for r in rows if r["method"] == "ddp"), None)
    for r in rows:
        ok = base is not None and base["time_to_target_s"] and r["time_to_target_s"]
        r["vs_ddp"] = r["time_to_target_s"] / base["time_to_target_s"] if ok else None
        r["fewer_bytes"] = base["payload_bytes_per_step"] / r["payload_bytes_per_step"] \
            if base is not None and r["payload_bytes_per_step"] else None
    return rows


def _fmt(value, spec: str, missing: str = "-") -> str:
    return missing if value is None else format(value, spec)


def _table(rows: list[dict]) -> list[str]:
    lines = ["| method | steps to target | time to target s [min-max] | vs ddp | final acc % | "
             "ms/step | B/step/rank | x fewer | loopback MB/step |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        if r["time_to_target_s"] is None:
            time_s = f"not reached (0/{r['rounds']})"
        else:
            time_s = f"{r['time_to_target_s']:.1f} [{r['time_min_s']:.1f}-{r['time_max_s']:.1f}]"
            if r["reached"] < r["rounds"]:
                time_s += f" ({r['reached']}/{r['rounds']} reached)"
        lo = r["loopback_bytes_per_step"]
        lines.append(
            f"| {r['method']} | {_fmt(r['steps_to_target'], '.0f')} | {time_s} | "
            f"{_fmt(r['vs_ddp'], '.2f')}{'x' if r['vs_ddp'] is not None else ''} | "
            f"{100 * r['final_accuracy']:.1f} | {r['ms_per_step']:.0f} | "
            f"{_bytes(r['payload_bytes_per_step'])} | {_fmt(r['fewer_bytes'], '.1f')} | "
            f"{_fmt(None if lo is None else lo / 1e6, '.2f')} |")
    return lines


def _bytes(n: float) -> str:
    for unit, scale in (("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def plot(runs: list[dict], methods, path: str, title: str, target: float) -> None:
    """Accuracy against training time, one line per method (its median run), into ``path``."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(9.5, 5.8), dpi=110)
    colors = plt.get_cmap("tab10").colors
    for k, name in enumerate(methods):
        mine = [r for r in runs if r["method"] == name]
        if not mine:
            continue
        run = _median_run(mine)
        style = dict(ls="--", lw=2.4, color="black") if name == "ddp" else \
            dict(lw=1.6, color=colors[k % len(colors)])
        ax.plot([c[1] for c in run["curve"]], [100 * c[2] for c in run["curve"]], marker="o",
                ms=3, label=name, **style)
    ax.axhline(100 * target, color="gray", lw=1, ls=":", label=f"target {100 * target:g} %")
    ax.set_xlabel("training time (s, evaluation excluded)")
    ax.set_ylabel("test accuracy (%)")
    ax.set_ylim(0, 100)
    ax.grid(True, alpha=0.4)
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=9, loc="lower right")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _parent(args) -> int:
    methods = _methods(args.methods)
    network = None
    if not args.no_network:
        from bench.net import Network, check_available
        why = check_available()
        if why:
            print(f"bench wall: cannot run on a limited network: {why}\n(--no-network runs "
                  f"the study on shared memory, without root)", file=sys.stderr)
            return 2
        network = Network(args.rate)
    where = "shared memory (no network)" if network is None else \
        f"MPI over TCP on a loopback limited to {network.rate}" if network.rate else \
        "MPI over TCP on an unlimited loopback"
    print(f"# bench wall: {args.ranks} ranks, {where}; CNN width {args.width} of "
          f"examples/train_ddp.py, batch {args.batch} per rank, {args.samples} training and "
          f"{args.test} test images; target {100 * args.target:g} % test accuracy, evaluated "
          f"every {args.eval_every} steps where the ranks agree; "
          f"{'runs end at the target, at most' if args.stop_at_target else 'every run trains'}"
          f" {args.steps} steps;"
          f" {args.rounds} round(s) of {len(methods)} methods, the order rotated each round",
          flush=True)
    tmp = tempfile.mkdtemp(prefix="bench-wall-")
    env = dict(os.environ, PYTHONUNBUFFERED="1", XDG_CACHE_HOME=os.path.join(tmp, "cache"),
               MPIR_CVAR_CH4_PROGRESS_THROTTLE="1", MPIEXEC_TIMEOUT=str(int(args.timeout)),
               PYTHONPATH=os.pathsep.join(filter(None, [_ROOT, os.environ.get("PYTHONPATH")])))
    runs = []
    try:
        for rnd in range(args.rounds):
            k = rnd % len(methods)
            order = methods[k:] + methods[:k]
            t0 = time.perf_counter()
            got = _run_round(args, order, rnd, os.path.join(tmp, f"round{rnd}.jsonl"), network,
                             env)
            for r in got:
                r["round"] = rnd
            runs += got
            print(f"# round {rnd + 1}/{args.rounds} ({time.perf_counter() - t0:.0f} s): "
                  + ", ".join(f"{r['method']} "
                              + (f"{r['time_to_target_s']:.1f} s" if r["reached"] else
                                 f"not reached ({100 * r['final_accuracy']:.1f} %)")
                              for r in got), flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    rows = summarise(runs, methods)
    print("\n".join(_table(rows)))
    config = {k: getattr(args, k) for k in ("rate", "ranks", "rounds", "no_network")
              + _TRAINING}
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": config, "methods": methods, "rows": rows, "runs": runs}, f,
                      indent=1)
    if args.plot:
        plot(runs, methods, args.plot,
             f"bench wall: {args.ranks} ranks, {where}, CNN width {args.width}, batch "
             f"{args.batch}/rank (median run of {args.rounds})", args.target)
    return 0


def main(argv=None) -> int:
    """``python -m bench wall``: the parent, or (``--job``) one round under mpiexec."""
    args = _parser().parse_args(argv)
    return _job(args) if args.job else _parent(args)


if __name__ == "__main__":
    raise SystemExit(main())
