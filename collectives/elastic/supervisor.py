"""The restart supervisor, for MPI libraries without fault tolerance (MPICH).

    python -m collectives.elastic run --np 4 --min-np 2 -- python train.py --checkpoint-dir D

runs ``mpiexec -n 4 python train.py ...`` and, when the job fails (a rank killed: ``mpiexec``
ends the others and exits non-zero), starts it again, on one rank fewer by default (the failed
rank's slot is taken as lost, as a failed node's would be; ``--same-size`` keeps ``--np``),
never below ``--min-np``, at most ``--max-restarts`` times. The training script resumes from its
newest complete checkpoint (``collectives.elastic.checkpoint``), which loads at any size; the
steps lost are those since that checkpoint, at most the checkpoint interval while a checkpoint
is written faster than the interval's steps run.

The job runs in a process group of its own. When it fails, everything left in that group is killed
before the next start; on SIGINT or SIGTERM the supervisor passes the signal on, kills what is
still there after ``--grace`` seconds, and exits 130 (SIGINT) or 143: no process is left behind.
The supervisor prints one JSON line at the end (``attempts``: ranks, exit status and seconds of
each; ``restart_seconds``: from each failure to the next start).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time

__all__ = ["main", "Supervisor"]


def _mpiexec() -> str:
    here = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    return here if os.path.exists(here) else (shutil.which("mpiexec") or "mpiexec")


class Supervisor:
    """Start, watch and restart one job (see the module doc)."""

    def __init__(self, command, np_, min_np, max_restarts=10, same_size=False, grace=5.0,
                 mpiexec=None, launcher_args=()):
        if not 1 <= min_np <= np_:
            raise ValueError(f"need 1 <= --min-np <= --np, got --np {np_} --min-np {min_np}")
        if not command:
            raise ValueError("no command to run: give it after --")
        self.command, self.np, self.min_np = list(command), np_, min_np
        self.max_restarts, self.same_size, self.grace = max_restarts, same_size, grace
        self.mpiexec = mpiexec or _mpiexec()
        self.launcher_args = list(launcher_args)
        self.proc = None
        self.attempts: list = []
        self.restart_seconds: list = []
        self.stopping = None

    def _kill_session(self, sig) -> None:
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass

    def _on_signal(self, signum, frame) -> None:
        self.stopping = signum
        self._kill_session(signum)

    def _end_session(self) -> None:
        """Nothing of the job outlives it: SIGKILL whatever is left in its process group."""
        self._kill_session(signal.SIGKILL)

    def run(self) -> int:
        old = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            return self._run()
        finally:
            for s, h in old.items():
                signal.signal(s, h)
            self._end_session()

    def _run(self) -> int:
        np_, failed_at = self.np, None
        while True:
            if failed_at is not None:
                self.restart_seconds.append(round(time.monotonic() - failed_at, 3))
            t0 = time.monotonic()
            cmd = [self.mpiexec, *self.launcher_args, "-n", str(np_), *self.command]
            self.proc = subprocess.Popen(cmd, start_new_session=True)
            rc = self._wait()
            self._end_session()
            self.attempts.append({"ranks": np_, "rc": rc,
                                  "seconds": round(time.monotonic() - t0, 3)})
            if self.stopping is not None:
                self._report()
                return 128 + self.stopping
            if rc == 0:
                self._report()
                return 0
            failed_at = time.monotonic()
            restarts = len(self.attempts) - 1
            nxt = np_ if self.same_size else np_ - 1
            if restarts >= self.max_restarts or nxt < self.min_np:
                why = (f"{restarts} restarts (--max-restarts {self.max_restarts})"
                       if restarts >= self.max_restarts else
                       f"{nxt} ranks would be fewer than --min-np {self.min_np}")
                sys.stderr.write(f"[collectives.elastic] job failed (exit status {rc}); not "
                                 f"restarting: {why}\n")
                self._report()
                return rc if rc > 0 else 1
            sys.stderr.write(f"[collectives.elastic] job failed (exit status {rc}) on {np_} "
                             f"ranks; restarting on {nxt} from the newest checkpoint\n")
            sys.stderr.flush()
            np_ = nxt

    def _wait(self) -> int:
        while True:
            try:
                rc = self.proc.wait(timeout=0.2)
                return rc
            except subprocess.TimeoutExpired:
                if self.stopping is not None:
                    deadline = time.monotonic() + self.grace
                    while time.monotonic() < deadline and self.proc.poll() is None:
                        time.sleep(0.05)
                    self._end_session()
                    return self.proc.wait()

    def _report(self) -> None:
        print(json.dumps({"supervisor": True, "attempts": self.attempts,
                          "restarts": len(self.attempts) - 1,
                          "restart_seconds": self.restart_seconds}), flush=True)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = []
    if "--" in argv:
        k = argv.index("--")
        argv, command = argv[:k], argv[k + 1:]
    p = argparse.ArgumentParser(prog="python -m collectives.elastic",
                                description="Restart an MPI job from its newest checkpoint "
                                            "when a rank fails.")
    sub = p.add_subparsers(dest="what", required=True)
    r = sub.add_parser("run", help="run CMD under mpiexec, restarting it on failure")
    r.add_argument("--np", type=int, required=True, help="ranks of the first start")
    r.add_argument("--min-np", type=int, default=1, help="never restart on fewer ranks")
    r.add_argument("--max-restarts", type=int, default=10)
    r.add_argument("--same-size", action="store_true",
                   help="restart on --np ranks (default: one fewer per failure)")
    r.add_argument("--grace", type=float, default=5.0,
                   help="seconds between passing on SIGINT/SIGTERM and SIGKILL")
    r.add_argument("--mpiexec", default=None, help="the launcher (default: this venv's)")
    r.add_argument("--launcher-arg", action="append", default=[],
                   help="an argument for the launcher (repeatable)")
    args = p.parse_args(argv)
    try:
        sup = Supervisor(command, args.np, args.min_np, args.max_restarts, args.same_size,
                         args.grace, args.mpiexec, args.launcher_arg)
    except ValueError as exc:
        p.error(str(exc))
    return sup.run()
