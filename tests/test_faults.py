"""Fault tests: each launches a real ``mpiexec -n 3`` job (tests/faults/*.py) and checks that it
ends in bounded time with the documented exit status and message.

These run in the in-process tier (plain ``pytest``): the test process is the launcher, never a
rank; under ``mpiexec`` they are skipped. The jobs run with ``COLLECTIVES_TIMEOUT=3``, so a hang
costs about 5 s. ``python tests/test_faults.py`` runs every scenario once and prints the table
of docs/reliability.md (scenario, exit status, wall time, what the user sees).
"""
from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

FAULTS = Path(__file__).resolve().parent / "faults"
TIMEOUT = 3            # COLLECTIVES_TIMEOUT of the jobs
LIMIT = 45             # hard wall-clock bound of one job (a hang that the watchdog missed)
WATCHDOG_EXIT = 124    # collectives.watchdog.EXIT_CODE


def _mpiexec():
    here = Path(sys.executable).parent / "mpiexec"
    return str(here) if here.exists() else shutil.which("mpiexec")


MPIEXEC = _mpiexec()
UNDER_MPI = any(k in os.environ for k in ("PMI_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE"))


class Job:
    """A finished job: exit status, output, wall time."""

    def __init__(self, rc, out, err, seconds):
        self.rc, self.out, self.err, self.seconds = rc, out, err, seconds

    @property
    def text(self) -> str:
        return self.out + self.err

    def __repr__(self):
        return (f"<Job rc={self.rc} {self.seconds:.1f} s>\n--- stdout\n{self.out[-3000:]}\n"
                f"--- stderr\n{self.err[-5000:]}")


def start_job(script, *args, n=3, runner=True, check=False, timeout=TIMEOUT, limit=LIMIT,
              env=None) -> subprocess.Popen:
    """Start ``tests/faults/script`` on ``n`` ranks (under ``python -m mpi4py`` if ``runner``)
    with ``COLLECTIVES_TIMEOUT=timeout`` (None: the default) and the settings in ``env``."""
    if MPIEXEC is None:
        pytest.skip("mpiexec not found")
    if UNDER_MPI:
        pytest.skip("launches its own mpiexec jobs: run the test without mpiexec")
    full = {k: v for k, v in os.environ.items() if not k.startswith("COLLECTIVES_")}
    full.update(COLLECTIVES_CHECK="1" if check else "0", MPIEXEC_TIMEOUT=str(limit + 15),
                PYTHONUNBUFFERED="1", **(env or {}))
    if timeout is not None:
        full["COLLECTIVES_TIMEOUT"] = str(timeout)
    cmd = [MPIEXEC, "-n", str(n), sys.executable] + (["-m", "mpi4py"] if runner else []) + \
        [str(FAULTS / script), *map(str, args)]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=full, start_new_session=True)


def launch(script, *args, limit=LIMIT, **kw) -> Job:
    """Run ``tests/faults/script`` to its end (``start_job``'s options); a hang fails."""
    start = time.monotonic()
    proc = start_job(script, *args, limit=limit, **kw)
    cmd = " ".join(proc.args)
    try:
        out, err = proc.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"{cmd} still running after {limit} s: a hang\n{out}\n{err}")
    return Job(proc.returncode, out, err, time.monotonic() - start)


def watchdog_ended(job: Job) -> None:
    """The watchdog ended ``job``: exit 124 within the timeout plus a margin (the job's start,
    about 1-2 s, and the other ranks' answers, at most a few)."""
    assert job.rc == WATCHDOG_EXIT, job
    assert job.seconds < TIMEOUT + 10, job
    assert "did not complete in" in job.err and "aborting the job" in job.err, job


# -- a rank skips a collective ----------------------------------------------------------------
@pytest.mark.parametrize("algorithm,mode", [("ring", "blocking"), ("ring", "nonblocking"),
                                            ("native", "blocking"),
                                            ("native", "nonblocking")])
def test_skipped_collective_is_named(algorithm, mode):
    job = launch("skip.py", algorithm, mode)
    watchdog_ended(job)
    assert f"allreduce #1 ({algorithm}, 1000 x float32, sum)" in job.err, job
    assert "rank 2: has NOT started #1" in job.err, job
    assert "rank 2 never joined #1" in job.err, job
    # Every rank still waiting says so (when asked, or when its own timer fired).
    for rank in (0, 1):
        assert re.search(rf"rank {rank}.*in allreduce #1", job.err), job
    if algorithm == "ring":  # a schedule knows the peer and the step
        assert "recv from rank 2" in job.err and "schedule ops done" in job.err, job


def test_skipped_count_exchange_is_named():
    """A rank skips an allgather whose row counts are learned: the others wait in the small
    exchange before the data, and the watchdog says so."""
    job = launch("skip.py", "exchange", "blocking")
    watchdog_ended(job)
    assert "allgather #1 (exchanging row counts: MPI_Allgather)" in job.err, job
    assert "rank 2 never joined #1" in job.err, job


def test_skipped_count_exchange_of_a_plan_is_named():
    """The same on a settled plan, whose exchange is the first step of the call itself."""
    job = launch("skip.py", "again", "blocking")
    watchdog_ended(job)
    assert re.search(r"allgather #3 \([a-z_]+, 1000 x float32\)", job.err), job
    assert "the exchange of every rank's counts" in job.err, job
    assert "rank 2 never joined #3" in job.err, job


def test_skipped_collective_with_checking_on():
    job = launch("skip.py", "ring", "blocking", check=True)
    watchdog_ended(job)
    assert "the cross-rank argument check" in job.err, job
    assert "rank 2 never joined #1" in job.err, job


# -- mismatched arguments with checking on ------------------------------------------------------
MISMATCHES = {
    "elements": "allreduce #0: arguments differ across ranks: rank 1 passed 14 elements, "
                "ranks 0 and 2 passed 12 elements",
    "ddp": "allreduce #0: arguments differ across ranks: rank 0 passed 10 elements, "
           "ranks 1 and 2 passed 20 elements",
    "dtype": "rank 1 passed float64, ranks 0 and 2 passed float32",
    "op": "rank 1 passed op max, ranks 0 and 2 passed op sum",
    "root": "reduce #0: arguments differ across ranks: rank 1 passed root 1, ranks 0 and 2 "
            "passed root 0",
    "collective": "allreduce #0: arguments differ across ranks: rank 1 called broadcast, "
                  "ranks 0 and 2 called allreduce",
    "counts": "rank 1 passed counts [2, 5, 5], ranks 0 and 2 passed counts [4, 4, 4]",
    "algorithm": "rank 1 chose algorithm native, ranks 0 and 2 chose algorithm ring",
    "out": "allreduce #0: rank 1 failed its own argument checks (ValueError: out has shape "
           "[13], expected [12]); ranks 0 and 2 passed theirs",
}


@pytest.mark.parametrize("kind", sorted(MISMATCHES))
def test_mismatch_raises_on_every_rank(kind):
    job = launch("mismatch.py", kind, check=True)
    assert job.rc == 0, job
    found = dict(re.findall(r"rank (\d): MismatchError: (.*?) \| buffers intact: True",
                            job.out))
    assert sorted(found) == ["0", "1", "2"], job
    assert len(set(found.values())) == 1, f"ranks disagree on the message: {found}"
    assert MISMATCHES[kind] in found["0"], job
    # The ranks still agree on the collectives' order: a correct call works afterwards.
    assert sorted(re.findall(r"rank (\d): after: 3", job.out)) == ["0", "1", "2"], job
    assert job.seconds < 20, job


# -- exceptions and dead ranks -------------------------------------------------------------------
@pytest.mark.parametrize("runner", [True, False], ids=["mpi4py-runner", "plain-python"])
@pytest.mark.parametrize("script", ["user_error.py", "early_error.py"])
def test_user_exception_aborts_the_job_at_once(script, runner):
    """Between collectives or before the first one, started either way: the job ends at once
    (mpi4py's runner, or the excepthook ``import collectives`` installed), the traceback once."""
    job = launch(script, runner=runner)
    assert job.rc == 1, job
    assert job.text.count("RuntimeError: rank 1: a bug") == 1, job
    assert job.seconds < 15, job
    if not runner:
        assert "[collectives] rank 1 of 3: uncaught RuntimeError: aborting the job" in job.err, job


def test_user_exception_with_the_hook_off_is_ended_by_watchdog():
    job = launch("user_error.py", runner=False, env={"COLLECTIVES_ABORT_ON_EXCEPTION": "0"})
    watchdog_ended(job)
    assert "RuntimeError: rank 1: a bug in user code" in job.err, job
    assert "allreduce #1 (" in job.err, job
    assert "rank 1: no answer" in job.err and "=> rank 1 did not answer" in job.err, job


def test_exception_before_the_first_collective_with_the_hook_off_is_ended_by_watchdog():
    """The others wait in the first call's Dup of the communicator (no side channel yet)."""
    job = launch("early_error.py", runner=False, env={"COLLECTIVES_ABORT_ON_EXCEPTION": "0"})
    watchdog_ended(job)
    assert "allreduce #0 (the first collective call on this communicator) did not complete" \
        in job.err, job
    assert "ranks 0 and 2 are in it" in job.err, job
    assert "=> rank 1 never joined" in job.err, job


@pytest.mark.parametrize("where", ["between", "first"])
def test_rank_stuck_in_compute_is_named(where):
    job = launch("stuck.py", *(["first"] if where == "first" else []), runner=False)
    watchdog_ended(job)
    if where == "first":
        assert "=> rank 1 never joined" in job.err, job
    else:
        assert "rank 1: has NOT started #1" in job.err, job
        assert "rank 1 never joined #1" in job.err, job


def test_stall_warning_by_default_then_no_abort_before_the_timeout():
    """No COLLECTIVES_TIMEOUT (the default, 600 s): a skipped collective prints the stall
    warning at every interval (shortened here to 1 s) and the job keeps waiting."""
    proc = start_job("skip.py", "native", "blocking", runner=False, timeout=None,
                     env={"COLLECTIVES_STALL_WARNING": "1"})
    deadline = time.monotonic() + 30
    err = ""
    try:
        import selectors
        sel = selectors.DefaultSelector()
        sel.register(proc.stderr, selectors.EVENT_READ)
        while time.monotonic() < deadline and err.count("is stalled; what each rank says") < 2:
            if sel.select(timeout=0.5):
                line = proc.stderr.readline()
                if not line:
                    break
                err += line
        still_running = proc.poll() is None
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
    assert still_running, err
    assert err.count("is stalled; what each rank says") >= 2, err
    assert "stall warning 1, COLLECTIVES_STALL_WARNING=1; the job is aborted at " \
           "COLLECTIVES_TIMEOUT=600 s" in err, err
    assert "rank 2: has NOT started #1" in err and "=> rank 2 never joined #1" in err, err
    assert "aborting the job" not in err, err


@pytest.mark.parametrize("runner", [True, False], ids=["mpi4py-runner", "plain-python"])
def test_killed_rank_ends_the_job(runner):
    job = launch("kill.py", runner=runner)
    assert job.rc != 0, job
    assert "signal 9" in job.text or "Killed" in job.text, job
    assert job.seconds < 15, job


# -- the DDP example: rank 0 passes 10 elements, the others 20 -------------------------------------
def test_lengths_with_checking_on():
    job = launch("lengths.py", check=True)
    assert job.rc == 1, job
    assert ("MismatchError: allreduce #0: arguments differ across ranks: rank 0 passed 10 "
            "elements, ranks 1 and 2 passed 20 elements") in job.err, job
    assert "completed" not in job.out, job


def test_lengths_native_truncation_is_an_error():
    # MPI's own allreduce reports the truncation on the rank that passed fewer elements.
    job = launch("lengths.py", "native")
    assert job.rc == 1, job
    assert "MessageSizeError: rank 0: allreduce #0 (native, 10 x float32, sum): a message " \
           "from another rank was longer than this rank expected" in job.err, job


def test_lengths_ring_size_guard():
    job = launch("lengths.py", "ring")
    assert job.rc == 1, job
    assert "MessageSizeError: rank" in job.err, job
    assert re.search(r"rank 1: expected \d+ bytes from rank 0, received \d+|rank 0: allreduce "
                     r"#0 \(ring, 10 x float32, sum\): a message from another rank was longer",
                     job.err), job


def test_lengths_ring_plain_python_ends_at_once():
    # The failed ranks' uncaught MessageSizeError aborts the job (the excepthook).
    job = launch("lengths.py", "ring", 10000, runner=False)
    assert job.rc == 1, job
    assert "MessageSizeError" in job.err and "uncaught MessageSizeError" in job.err, job
    assert job.seconds < 15, job


def test_lengths_ring_with_the_hook_off_watchdog_names_ranks():
    # The failed ranks exit; rank 2 waits until the watchdog ends it.
    job = launch("lengths.py", "ring", 10000, runner=False,
                 env={"COLLECTIVES_ABORT_ON_EXCEPTION": "0"})
    watchdog_ended(job)
    assert "MessageSizeError" in job.err, job
    assert "=> ranks 0 and 1 did not answer" in job.err, job


# -- the watchdog in one process -----------------------------------------------------------------
class _Work:
    """Work that never completes, waiting on a made-up peer."""
    done = False
    error = None

    def waiting_for(self):
        return "recv from rank 7 (op 3 of 9)"


@pytest.fixture
def self_ctx():
    from mpi4py import MPI

    from collectives.executor import context
    return context(MPI.COMM_SELF)


@pytest.fixture
def aborted(monkeypatch):
    """The times the watchdog would have aborted the job (it does not, here); its answers
    waited for briefly."""
    from collectives import watchdog
    times = []
    monkeypatch.setattr(watchdog.monitor, "_abort", lambda: times.append(time.monotonic()))
    monkeypatch.setattr(watchdog.monitor, "_FIRED", False)
    monkeypatch.setattr(watchdog.monitor, "_grace", lambda: 0.1)
    return times


def _until(aborted, start, tick=0.05):
    """Wait until the watchdog fired, or 10 s from ``start``."""
    while not aborted and time.monotonic() - start < 10:
        time.sleep(tick)


def test_timeout_setting():
    from collectives import config, watchdog
    old = watchdog.set_timeout("2.5")
    try:
        assert watchdog.timeout() == 2.5 and watchdog.enabled()
        assert watchdog.set_timeout("0") == 2.5 and watchdog.enabled()  # the stall warning
        stall = config.set("COLLECTIVES_STALL_WARNING", "0")
        assert not watchdog.enabled()
        config.set("COLLECTIVES_STALL_WARNING", stall)
        for bad in ("soon", "-1", "nan"):
            with pytest.raises(ValueError, match="COLLECTIVES_TIMEOUT"):
                watchdog.set_timeout(bad)
        assert watchdog.timeout() == 0  # a refused value changes nothing
        watchdog.set_timeout(42)
        assert watchdog.timeout() == 42
    finally:
        assert watchdog.set_timeout(old) == 42
    assert config.SETTINGS["COLLECTIVES_TIMEOUT"].default == 600  # torch's default
    assert config.SETTINGS["COLLECTIVES_STALL_WARNING"].default == 60  # Horovod's
    assert watchdog.EXIT_CODE == WATCHDOG_EXIT


def test_labels_nest_and_reset(self_ctx):
    from collectives import watchdog
    with watchdog.label("DDP bucket 3 of 7: fc1.weight, fc1.bias"):
        with watchdog.label("retry 2"):
            entry = watchdog.watch(self_ctx, what="allreduce #9 (ring, 5 x float32, sum)")
        outer = watchdog.watch(self_ctx, what="x")
    bare = watchdog.watch(self_ctx, what="y")
    try:
        assert entry.describe() == ("allreduce #9 (ring, 5 x float32, sum) "
                                    "[DDP bucket 3 of 7: fc1.weight, fc1.bias / retry 2]")
        assert outer.describe() == "x [DDP bucket 3 of 7: fc1.weight, fc1.bias]"
        assert bare.describe() == "y"
        assert "DDP bucket 3 of 7" in watchdog.report(self_ctx)
    finally:
        for e in (entry, outer, bare):
            watchdog.unwatch(e)
    assert watchdog.report(self_ctx) == "nothing in flight"


def test_a_running_schedule_names_its_peer_and_step():
    # Ranks 0 and 1 of a 3-rank ring run; rank 2 never starts: 0 waits on 2, 1 on 0.
    import numpy as np

    from collectives import ring, watchdog
    from collectives.executor import Run
    from collectives.ops import resolve
    from collectives.sim import SimNetwork
    net = SimNetwork(3)
    runs = []
    for r in (0, 1):
        s = ring.allreduce(r, 3, 30, seg=4)
        x = np.ones(30, np.float32)
        runs.append(Run(s.plan(), x, np.zeros(30, np.float32), np.zeros(s.tmp, np.float32),
                        resolve("sum", np.float32), net.transport(r), 0).start())
    for _ in range(5):
        net.match()
        for run in runs:
            run.test()
    text0 = watchdog.registry.posted(runs[0].plan, runs[0].hops)
    assert text0.startswith("recv from rank 2 (op"), text0
    assert "send to rank 1" not in text0   # the sends to rank 1 were taken
    assert "recv from rank 0" in watchdog.registry.posted(runs[1].plan, runs[1].hops)


def test_watchdog_lists_many_posted_ops_as_runs():
    """A large message in small segments posts 10^5 operations at once: the report names them
    as runs of numbers and counts what is past the first few, instead of 10^5 numbers."""
    from collectives import watchdog
    assert watchdog.registry.spans([3]) == "3"
    assert watchdog.registry.spans([1, 4, 5, 6, 9]) == "1, 4-6, 9"
    assert watchdog.registry.spans(list(range(489, 174763))) == "489-174762"
    many = list(range(0, 40, 2))  # 20 single ops
    assert watchdog.registry.spans(many) == "0, 2, 4, 6, 8, 10 and 14 more"


def test_watchdog_fires_reports_and_aborts(self_ctx, capsys, aborted):
    from collectives import watchdog
    old = watchdog.set_timeout(0.3)
    with watchdog.label("bucket 0"):
        entry = watchdog.watch(self_ctx, what="allreduce #0 (ring, 8 x float32, sum)")
    entry.attach(_Work())
    start = time.monotonic()
    try:
        _until(aborted, start)
    finally:
        watchdog.set_timeout(old)
        watchdog.unwatch(entry)
    assert aborted, "the watchdog did not fire"
    assert 0.3 <= aborted[0] - start < 3
    err = capsys.readouterr().err
    assert "rank 0: allreduce #0 (ring, 8 x float32, sum) [bucket 0] did not complete" in err
    assert "waiting for: recv from rank 7 (op 3 of 9)" in err
    assert "aborting the job: MPI_Abort(COMM_WORLD, 124)" in err


def test_a_failed_side_channel_does_not_stop_the_watchdog(self_ctx, capsys, aborted):
    """A side channel whose communicator fails under it (a dead peer, a revoked communicator:
    MPI raises from its probe) is closed and said once; the watchdog goes on and still ends a
    late collective."""
    from collectives import watchdog
    from collectives.watchdog import registry
    from collectives.watchdog.channel import Channel

    class Revoked:
        def improbe(self, *args):
            raise RuntimeError("MPI_ERR_REVOKED: communicator revoked")

    broken = Channel(self_ctx)  # registered beside the context's own
    broken.comm = Revoked()
    old = watchdog.set_timeout(0.5)
    entry = watchdog.watch(self_ctx, what="allreduce #0 (ring, 8 x float32, sum)")
    entry.attach(_Work())
    start = time.monotonic()
    try:
        _until(aborted, start)
    finally:
        watchdog.set_timeout(old)
        watchdog.unwatch(entry)
        broken.close()
    assert aborted, "the watchdog stopped at the failed channel"
    err = capsys.readouterr().err
    assert err.count("side channel of a communicator of 1 ranks failed") == 1, err
    assert "MPI_ERR_REVOKED" in err and "internal error" not in err, err
    assert broken.closed and broken not in registry.CHANNELS


def test_a_blocking_call_is_watched_through_its_reused_entry(self_ctx, capsys, aborted):
    """``enter``: one entry per communicator, stamped by the watchdog thread when it first sees
    the call running; a call that ended is not reported; a late one fires within a tick or two
    of the timeout."""
    from collectives import config, watchdog

    class Call:
        seq = 4

        def describe(self):
            return "allreduce #4 (native, 2 x float32, sum)"
    old = watchdog.set_timeout(0.4)
    stall = config.set("COLLECTIVES_STALL_WARNING", 0)
    try:
        done = watchdog.enter(self_ctx, Call())
        done.release()  # a call that returned at once
        time.sleep(0.3)
        assert not aborted and "nothing in flight" == watchdog.report(self_ctx)
        entry = watchdog.enter(self_ctx, Call())
        assert entry is done  # the communicator's one entry, reused
        entry.attach(_Work())
        start = time.monotonic()
        _until(aborted, start, 0.02)
    finally:
        watchdog.set_timeout(old)
        config.set("COLLECTIVES_STALL_WARNING", stall)
        entry.release()
    assert aborted, "the watchdog did not fire"
    assert 0.4 <= aborted[0] - start < 3
    err = capsys.readouterr().err
    assert "rank 0: allreduce #4 (native, 2 x float32, sum) did not complete" in err
    assert "waiting for: recv from rank 7 (op 3 of 9)" in err
    assert watchdog.enter(self_ctx, Call()) is entry
    entry.release()
    old = watchdog.set_timeout(0)
    stall = config.set("COLLECTIVES_STALL_WARNING", 0)
    try:
        assert watchdog.enter(self_ctx, Call()) is None  # off: nothing to do per call
    finally:
        watchdog.set_timeout(old)
        config.set("COLLECTIVES_STALL_WARNING", stall)


def test_summary_names_the_ranks_that_never_joined(self_ctx):
    from collectives import watchdog

    class Ctx:  # a 5-rank communicator seen from rank 0
        rank, size, seq, stash, comm = 0, 5, 6, {}, None

    class Call:
        seq = 5

        def describe(self):
            return "allreduce #5 (ring, 8 x float32, sum)"
    entry = watchdog.Entry.collective(Ctx, Call())
    in_it = {"started": 6, "inflight": [(5, "allreduce #5 (...)", 3.1, "recv from rank 3")],
             "last_error": None}
    answers = {
        1: in_it,
        2: {"started": 7, "inflight": [], "last_error": None},                 # finished
        3: {"started": 5, "inflight": [], "last_error": None},                 # skipped it
        # rank 4: no answer
    }
    text = watchdog.monitor.summary(entry, in_it, answers)
    assert "rank 2: finished #5; now idle" in text
    assert "rank 3: has NOT started #5 (it started 5 collectives" in text
    assert "rank 4: no answer" in text
    assert "=> rank 3 never joined #5" in text
    assert "=> rank 4 did not answer" in text
    everyone = watchdog.monitor.summary(entry, in_it, {r: in_it for r in range(1, 5)})
    assert "every rank is in it" in everyone and "COLLECTIVES_CHECK=1" in everyone


# -- the table of docs/reliability.md ------------------------------------------------------------
HOOK_OFF = {"env": {"COLLECTIVES_ABORT_ON_EXCEPTION": "0"}}
SCENARIOS = [
    ("exception on rank 1 before the first collective", "early_error.py", (),
     {"runner": False}),
    ("the same, `python -m mpi4py`", "early_error.py", (), {}),
    ("the same, `COLLECTIVES_ABORT_ON_EXCEPTION=0`", "early_error.py", (),
     {"runner": False, **HOOK_OFF}),
    ("exception on rank 1 between collectives", "user_error.py", (), {"runner": False}),
    ("the same, `python -m mpi4py`", "user_error.py", (), {}),
    ("the same, `COLLECTIVES_ABORT_ON_EXCEPTION=0`", "user_error.py", (),
     {"runner": False, **HOOK_OFF}),
    ("a rank skips an allreduce (ring)", "skip.py", ("ring", "blocking"), {"runner": False}),
    ("a rank skips an iallreduce (native)", "skip.py", ("native", "nonblocking"),
     {"runner": False}),
    ("a rank skips an allreduce, checking on", "skip.py", ("ring", "blocking"),
     {"check": True, "runner": False}),
    ("rank 1 SIGKILLed mid-collective", "kill.py", (), {"runner": False}),
    ("rank 1 stuck in compute between collectives", "stuck.py", (), {"runner": False}),
    ("rank 1 stuck in compute before the first collective", "stuck.py", ("first",),
     {"runner": False}),
    ("10 vs 20 elements, checking on", "lengths.py", (), {"check": True, "runner": False}),
    ("10 vs 20 elements, checking off (auto: native)", "lengths.py", (), {"runner": False}),
    ("10 vs 20 elements, checking off, ring", "lengths.py", ("ring",), {"runner": False}),
    ("10k vs 20k elements, ring, `COLLECTIVES_ABORT_ON_EXCEPTION=0`", "lengths.py",
     ("ring", 10000), {"runner": False, **HOOK_OFF}),
    *[(f"mismatch: {k}, checking on", "mismatch.py", (k,), {"check": True})
      for k in sorted(MISMATCHES)],
]


def _gist(job: Job) -> str:
    """The line a user would read first."""
    patterns = (r"^(=> .*)$",
                r"rank \d: (MismatchError: .*?) \| buffers intact",
                r"^(?:collectives\.errors\.|builtins\.)?((?:MismatchError|MessageSizeError|"
                r"RuntimeError): .*)$",
                r"(KILLED BY SIGNAL: 9.*|Killed \(signal 9\))")
    for pattern in patterns:
        found = re.search(pattern, job.text, re.MULTILINE)
        if found:
            return found.group(1).strip().replace("|", "/")
    return job.text.strip().splitlines()[-1] if job.text.strip() else ""


def main() -> None:
    """Every scenario as a real job (``COLLECTIVES_TIMEOUT=3``, plain ``python`` unless the row
    says otherwise): the table of docs/reliability.md."""
    print("| scenario | exit status | wall time | what the user sees |")
    print("| --- | --- | --- | --- |")
    for title, script, args, kw in SCENARIOS:
        job = launch(script, *args, **kw)
        print(f"| {title} | {job.rc} | {job.seconds:.1f} s | {_gist(job)[:220]} |", flush=True)


if __name__ == "__main__":
    main()


# -- the daemon threads end before the interpreter does ------------------------------------------
def test_worker_runs_in_order_then_stops():
    from collectives.progress import Worker
    seen = []
    worker = Worker("test-worker", seen.append)
    for i in range(5):
        worker.put(i)
    worker.stop()
    assert seen == list(range(5))
    assert not worker.thread.is_alive()


def test_worker_holds_nothing_while_idle():
    """An idle worker keeps no reference to its last item: a buffer it held could otherwise be
    freed by that thread while the interpreter finalizes (an abort inside torch's C++)."""
    import threading
    import weakref

    from collectives.progress import Worker

    class Item:
        pass

    handled = threading.Event()
    worker = Worker("test-worker", lambda item: handled.set())
    item = Item()
    ref = weakref.ref(item)
    worker.put(item)
    del item
    assert handled.wait(5)
    deadline = time.monotonic() + 5
    while ref() is not None and time.monotonic() < deadline:
        time.sleep(0.01)
    worker.stop()
    assert ref() is None
