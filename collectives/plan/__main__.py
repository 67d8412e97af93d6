"""``python -m collectives.plan``: the ranked table of plans for a GPT shape on a cluster.

    python -m collectives.plan --layers 96 --dim 12288 --heads 96 --seq 2048 --vocab 51200 \\
        --ranks 4096 --ranks-per-node 8 --memory-per-rank 80GB --global-batch 1536 \\
        --precision mixed --flops 300e12 --node-bandwidth 300e9 --net-bandwidth 25e9
    python -m collectives.plan ... --json        # every listed plan as JSON, one list

Compute is priced from ``--flops`` (FLOP/s a rank sustains) or, with ``--measure``, measured
once on this machine with examples/train_gpt.py's block. Collectives use the calibrated cost
model (``python -m bench calibrate``, ``COLLECTIVES_COST_MODEL``) with any link's latency or
bandwidth replaced by the flags, for a cluster that is not this machine.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

from .model import PRECISIONS, gpt
from .search import parse_bytes, search
from .timing import FlopRate, Network

__all__ = ["main", "parser", "table", "example_compute"]


def parser() -> argparse.ArgumentParser:
    """The command's flags."""
    p = argparse.ArgumentParser(prog="python -m collectives.plan",
                                description=__doc__.splitlines()[0])
    g = p.add_argument_group("model")
    g.add_argument("--layers", type=int, required=True)
    g.add_argument("--dim", type=int, required=True)
    g.add_argument("--heads", type=int, required=True)
    g.add_argument("--seq", type=int, required=True)
    g.add_argument("--vocab", type=int, required=True)
    g.add_argument("--ffn", type=int, default=None, help="MLP width (4 dim)")
    g.add_argument("--attention", choices=("sdpa", "math"), default="sdpa")
    g.add_argument("--untied", action="store_true", help="the head has its own weight")
    g.add_argument("--precision", choices=tuple(PRECISIONS), default="fp32")
    c = p.add_argument_group("cluster")
    c.add_argument("--ranks", type=int, required=True)
    c.add_argument("--ranks-per-node", type=int, default=1)
    c.add_argument("--memory-per-rank", default=None, help="bytes: 80GB, 512M (no limit)")
    c.add_argument("--global-batch", type=int, required=True, help="sequences per step")
    c.add_argument("--flops", type=float, default=None,
                   help="FLOP/s one rank sustains (compute from FLOPs)")
    c.add_argument("--measure", action="store_true",
                   help="measure one block on this machine instead of --flops")
    c.add_argument("--optimizer-rate", type=float, default=1e11,
                   help="parameters per second one rank's optimizer steps (with --flops)")
    for link in ("node", "net"):
        c.add_argument(f"--{link}-latency", type=float, default=None, help="seconds")
        c.add_argument(f"--{link}-bandwidth", type=float, default=None, help="bytes/s")
    c.add_argument("--reduce-bandwidth", type=float, default=None,
                   help="bytes/s of a reduction's result (the cost model's gamma)")
    c.add_argument("--call-overhead", type=float, default=None,
                   help="seconds of a collective call's fixed cost")
    c.add_argument("--device", action="store_true",
                   help="training runs on accelerators: the host's node windows take none of "
                        "their memory")
    c.add_argument("--overlap", type=float, default=None,
                   help="share of the last backward that hides data-parallel communication "
                        "(0 with --measure, else 1)")
    s = p.add_argument_group("search")
    s.add_argument("--top", type=int, default=20, help="plans to list (20)")
    s.add_argument("--runnable", action="store_true",
                   help="only what examples/train_gpt.py runs (ZeRO 0-1 with a pipeline)")
    s.add_argument("--max-micro-batch", type=int, default=None)
    s.add_argument("--json", action="store_true", help="print the plans as JSON")
    return p


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)


def table(plans) -> str:
    """The ranked plans as a Markdown table."""
    rows = ["| # | plan | step (s) | memory/rank | bubble | node B/step | net B/step |",
            "| ---: | --- | ---: | ---: | ---: | ---: | ---: |"]
    for i, q in enumerate(plans, 1):
        rows.append(f"| {i} | {q.name()} | {q.step_time:.4g} | {_size(q.memory)} | "
                    f"{q.bubble:.3f} | {_size(q.link_bytes.get('node', 0))} | "
                    f"{_size(q.link_bytes.get('net', 0))} |")
    return "\n".join(rows)


def example_compute(repeats: int = 5):
    """``Measured`` compute built on examples/train_gpt.py's block and head (from the
    repository's examples folder)."""
    import importlib.util
    import os

    import torch.nn.functional as F
    from torch import nn

    from .timing import Measured
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
        os.path.abspath(__file__)))), "examples", "train_gpt.py")
    spec = importlib.util.spec_from_file_location("train_gpt_for_plan", path)
    ex = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ex)

    def block(model, tp):
        blk = ex.Block(model.dim, model.heads, model.attention)
        h, width = model.dim, model.dim // tp  # a rank's heads, head by head
        blk.attn.qkv = nn.Linear(h, 3 * width, bias=False)
        blk.attn.proj = nn.Linear(width, h, bias=False)
        blk.mlp.fc1 = nn.Linear(h, model.ffn // tp, bias=False)
        blk.mlp.fc2 = nn.Linear(model.ffn // tp, h, bias=False)
        return blk

    class Head(nn.Module):
        def __init__(self, h, v):
            super().__init__()
            self.norm, self.head = nn.LayerNorm(h), nn.Linear(h, v, bias=False)

        def forward(self, x, y):
            z = self.head(self.norm(x))
            return F.cross_entropy(z.reshape(-1, z.shape[-1]), y.reshape(-1))

    return Measured(block, Head, repeats=repeats)


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    model = gpt(args.layers, args.dim, args.heads, args.seq, args.vocab, args.ffn,
                args.attention, not args.untied, args.precision)
    if args.measure == (args.flops is not None):
        raise SystemExit("give one of --flops RATE or --measure")
    compute = example_compute() if args.measure else FlopRate(args.flops, args.optimizer_rate)
    net = Network(ranks_per_node=args.ranks_per_node,
                  overlap=args.overlap if args.overlap is not None else
                  (0.0 if args.measure else 1.0), host=not args.device)
    links = {k: (getattr(args, f"{k}_latency"), getattr(args, f"{k}_bandwidth"))
             for k in ("node", "net")}
    links = {k: v for k, v in links.items() if v != (None, None)}
    if "node" in links:
        links["numa"] = links["node"]
    if links:
        net.model = net.model.replace(**links)
    if args.reduce_bandwidth is not None or args.call_overhead is not None:
        from collectives.costmodel import CostModel
        m = net.model
        net.model = CostModel(m.alpha, m.bandwidth, args.reduce_bandwidth or m.reduce_bandwidth,
                              m.copy_bandwidth, m.overhead,
                              m.call if args.call_overhead is None else args.call_overhead,
                              m.source, m.switch, m.curves)
    t0, c0 = time.perf_counter(), time.process_time()
    plans = search(model, args.ranks, args.global_batch,
                   parse_bytes(args.memory_per_rank) if args.memory_per_rank else None,
                   args.ranks_per_node, net, compute, top=args.top, runnable=args.runnable,
                   max_micro_batch=args.max_micro_batch)
    took, cpu = time.perf_counter() - t0, time.process_time() - c0
    if args.json:
        print(json.dumps([q.to_dict() for q in plans]))
        return 0 if plans else 1
    print(f"{model.params() / 1e9:.3g}B parameters on {args.ranks} ranks "
          f"({args.ranks_per_node} a node), {args.global_batch} sequences of {args.seq} a step; "
          f"planned in {took:.2f} s ({cpu:.2f} s of CPU)")
    if not plans:
        print("no plan fits")
        return 1
    print(table(plans))
    return 0


if __name__ == "__main__":
    sys.exit(main())
