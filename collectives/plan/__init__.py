"""collectives.plan: predict memory and step time for every way to split a GPT over a number of
ranks, drop what does not fit, rank the rest.

    from collectives import plan
    model = plan.gpt(layers=24, dim=2048, heads=16, seq=2048, vocab=50304)
    plans = plan.search(model, ranks=64, global_batch=512, memory_per_rank="80GB",
                        ranks_per_node=8, compute=plan.FlopRate(300e12))
    best = plans[0]   # dp, tp, pp, schedule, virtual, microbatches, zero, recompute; .memory

``model`` (the shape), ``memory`` (the memory model), ``timing`` (compute, collectives and the
pipeline priced), ``search`` (the enumeration), ``record`` (``Plan``), ``measure`` (a process's
resident set and its peak, for checking); ``python -m collectives.plan`` prints the ranked
table. docs/plan.md has the formulas and the validation.
"""
from .model import GPTShape, PRECISIONS, gpt
from .memory import in_flight, layer_activations, memory
from .record import Plan
from .search import candidates, parse_bytes, search
from .timing import FlopRate, Measured, Network, lower_bound, step_time

__all__ = ["GPTShape", "PRECISIONS", "gpt", "in_flight", "layer_activations", "memory", "Plan",
           "candidates", "parse_bytes", "search", "FlopRate", "Measured", "Network",
           "lower_bound", "step_time", "calibrated"]


def calibrated(ranks_per_node: int = 1, overlap: float = 0.0, cores: int | None = None) \
        -> Network:
    """The network of this machine's calibrated cost model (``python -m bench calibrate``)."""
    return Network(ranks_per_node=ranks_per_node, overlap=overlap, cores=cores)
