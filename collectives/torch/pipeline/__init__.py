"""collectives.torch.pipeline: pipeline parallelism with schedules as data.

    from collectives.torch import pipeline as pp
    sched = pp.schedule("1f1b", stages=4, microbatches=8)    # gpipe | 1f1b | interleaved | zero_bubble
    pp.verify(sched)                                          # in one process: runs to the end
    pp.simulate(sched, forward=1.0, backward=2.0)             # step, bubble, peak activations
    runner = pp.Pipeline(stage_module, comm=pp_comm, schedule=sched, loss_fn=loss_fn)
    loss = runner.step(x, target)                             # on every stage

``schedules`` builds the actions (and imports neither torch nor mpi4py), ``verify`` proves
them, ``simulate`` prices them, ``runner`` executes them over MPI, ``split`` cuts a model into
stages. docs/pipeline.md walks through all of it.
"""
from .schedules import Action, Schedule, SCHEDULES, schedule
from .verify import ScheduleError, verify
from .simulate import Simulation, p2p_time, simulate
from .runner import Pipeline, PipelineError
from .split import split

__all__ = ["Action", "Schedule", "SCHEDULES", "schedule", "verify", "ScheduleError",
           "simulate", "Simulation", "p2p_time", "Pipeline", "PipelineError", "split"]
