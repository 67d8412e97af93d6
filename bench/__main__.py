"""``python -m bench <command> [options]``: dispatch to ``bench.<command>.main(argv)``.

Commands: the collectives (allreduce, reduce_scatter, allgather, broadcast, reduce, alltoall,
gather, scatter),
``overhead`` (the API's per-call cost against bare mpi4py), ``memory`` (resident memory over a
long loop of calls), ``ddp`` (data-parallel training
step), ``fsdp`` (torch's FSDP2 on the backend against gloo; it launches its own jobs, so it runs
without mpiexec), ``tune`` (measure and write the table ``auto`` reads), ``calibrate`` and
``model`` (the alpha-beta-gamma cost model), ``plot`` (redraw JSON results), ``docs``
(regenerate the documentation's sample outputs), ``topology`` (what a job sees of nodes and NUMA
domains, and the bytes each algorithm sends per link class), ``net`` (run a command on a
rate-limited network), ``cluster`` (run a job on hosts built on this machine) and ``wall``
(the communication study on that network; it launches its jobs).
"""
from __future__ import annotations

import importlib
import sys

__all__ = ["COMMANDS", "main"]

COMMANDS = {
    "allreduce": "bandwidth/latency of every allreduce algorithm, MPI's and gloo's",
    "reduce_scatter": "the same for reduce-scatter",
    "allgather": "the same for all-gather",
    "broadcast": "the same for broadcast",
    "reduce": "the same for reduce",
    "alltoall": "the same for all-to-all (mixture-of-experts token dispatch)",
    "gather": "the same for gather",
    "scatter": "the same for scatter",
    "overhead": "per-call cost of coll.allreduce against bare mpi4py, small sizes",
    "memory": "resident memory over thousands of calls of each non-blocking form",
    "ddp": "data-parallel training step time (torch)",
    "fsdp": "torch's FSDP2 step on the collectives backend against gloo (launches its jobs)",
    "zero": "ZeRO stages 1-3 against our DDP: step time, bytes per parameter, peak RSS",
    "elastic": "elastic training's cost a step: in-memory commit, asynchronous checkpoint",
    "tp": "tensor-parallel GPT step: our layers against torch's DTensor on gloo and on ours",
    "tune": "measure every algorithm and write the tuning table auto reads",
    "calibrate": "measure alpha, beta, gamma of this machine for the cost model",
    "model": "predict every algorithm's time at any scale (--validate: against measurement)",
    "plot": "draw busbw vs size from JSON results",
    "docs": "regenerate the sample outputs in README.md and docs/ from their commands",
    "ps": "parameter server: straggler study (BSP, SSP, ASP), bytes against allreduce",
    "pipeline": "pipeline schedules: step, bubble, activations beside pp.simulate and torch's",
    "plan": "the planner against measurement: every plan of the example GPT (launches its jobs)",
    "topology": "the nodes and NUMA domains a job sees; --traffic: bytes per link class",
    "net": "run any command over MPI's TCP transport on a rate-limited loopback (needs root)",
    "cluster": "run an MPI job on hosts built on this machine, linked at a rate (needs root)",
    "wall": "communication study on a rate-limited network: time to target per method",
}


def usage() -> str:
    """The help text: every command and what it does."""
    lines = ["usage: [mpiexec -n N] python -m bench <command> [options]", "", "commands:"]
    lines += [f"  {name:<15} {text}" for name, text in COMMANDS.items()]
    lines += ["", "python -m bench <command> -h shows a command's options"]
    return "\n".join(lines)


def main(argv=None) -> int:
    """Run ``bench.<argv[0]>.main(argv[1:])``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage())
        return 0
    name = argv[0].replace("-", "_")
    if name not in COMMANDS:
        print(f"unknown command {argv[0]!r}\n\n{usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(f"bench.{name}")
    return module.main(argv[1:]) or 0


if __name__ == "__main__":
    sys.exit(main())
