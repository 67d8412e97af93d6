"""``Plan``: one way to run a model on a number of ranks, and what the planner predicts for it."""
from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["Plan"]


@dataclass
class Plan:
    """dp x tp x pp ranks (``Mesh((pp, dp, tp), ("pp", "dp", "tp"))``: tp fastest), sequence
    parallelism, the pipeline schedule with its virtual stages per rank and micro-batches, the
    ZeRO stage (0: DistributedDataParallel) and the recompute policy (none, selective, full);
    ``micro_batch`` sequences per micro-batch on each data-parallel rank.

    Filled by the planner: ``memory`` (predicted peak bytes on the fullest rank), ``step_time``
    (seconds), ``bubble`` (the pipeline's idle share), ``link_bytes`` (bytes this rank sends per
    step over each link class: "node", "net") and ``breakdown`` (the memory and time terms)."""

    dp: int
    tp: int
    pp: int
    sequence_parallel: bool
    schedule: str
    virtual: int
    microbatches: int
    zero: int
    recompute: str
    micro_batch: int
    memory: int = 0
    step_time: float = 0.0
    bubble: float = 0.0
    link_bytes: dict = field(default_factory=dict)
    breakdown: dict = field(default_factory=dict)

    @property
    def ranks(self) -> int:
        """Ranks the plan uses."""
        return self.dp * self.tp * self.pp

    def name(self) -> str:
        """A short label: ``dp2 tp2 pp1 sp zero1 full`` (the schedule where pp > 1)."""
        parts = [f"dp{self.dp}", f"tp{self.tp}", f"pp{self.pp}"]
        if self.sequence_parallel:
            parts.append("sp")
        if self.pp > 1:
            parts.append(self.schedule + (f"x{self.virtual}" if self.virtual > 1 else "")
                         + f" m{self.microbatches}")
        parts += [f"zero{self.zero}", self.recompute]
        return " ".join(parts)

    def to_dict(self) -> dict:
        """The JSON form."""
        return {"dp": self.dp, "tp": self.tp, "pp": self.pp,
                "sequence_parallel": self.sequence_parallel, "schedule": self.schedule,
                "virtual": self.virtual, "microbatches": self.microbatches, "zero": self.zero,
                "recompute": self.recompute, "micro_batch": self.micro_batch,
                "memory": self.memory, "step_time": self.step_time, "bubble": self.bubble,
                "link_bytes": dict(self.link_bytes), "breakdown": dict(self.breakdown)}

    def args(self) -> list[str]:
        """The plan as examples/train_gpt.py's flags."""
        out = ["--dp", str(self.dp), "--tp", str(self.tp), "--pp", str(self.pp),
               "--zero", str(self.zero), "--recompute", self.recompute]
        if self.sequence_parallel:
            out.append("--sequence-parallel")
        if self.pp > 1:
            out += ["--schedule", self.schedule, "--virtual", str(self.virtual),
                    "--microbatches", str(self.microbatches)]
        return out
