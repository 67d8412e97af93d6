"""Benchmarks of the collectives toolkit, run as ``[mpiexec -n N] python -m bench <command>``.

One small module per collective (``allreduce``, ``reduce_scatter``, ``allgather``,
``broadcast``, ``reduce``: a ``bench.collective.Collective``) on one timing loop
(``bench.harness``), with the statistics (``bench.stats``), the nccl-tests table and JSON/CSV
(``bench.report``), sizes and units (``bench.units``) and the command line (``bench.cli``) apart;
baselines (MPI's own collective as ``native``, torch's gloo in ``bench.gloo``), plots
(``bench.plot``), the API's per-call cost (``bench.overhead``), the tuner that writes the table
``auto`` reads (``bench.tune``) and the alpha-beta-gamma cost model's commands
(``bench.calibrate``, ``bench.model``). Every command module has ``main(argv=None)``.
"""

__all__: list[str] = []
