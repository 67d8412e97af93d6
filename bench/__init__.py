"""Benchmarks of the collectives toolkit, run as ``[mpiexec -n N] python -m bench <command>``.

One small module per collective (``allreduce``, ``reduce_scatter``, ``allgather``,
``broadcast``, ``reduce``) on one harness (``bench.harness``: sizes, init data, busbw factor,
timing, nccl-tests table, JSON/CSV), baselines (MPI's own collective as ``native``, torch's
gloo in ``bench.gloo``), plots (``bench.plot``), the tuner that writes the table ``auto`` reads
(``bench.tune``) and the alpha-beta-gamma cost model's commands (``bench.calibrate``,
``bench.model``). Every command module has ``main(argv=None)``.
"""

__all__: list[str] = []
