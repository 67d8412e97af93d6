"""What the elastic tests do to the jobs they launch: read a job's announcements until a step,
kill a rank there from outside, and wait for the job's end within a bound."""
from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest

__all__ = ["finish", "kill_at"]


def finish(proc, limit: float):
    """``(returncode, stdout, stderr)`` of ``proc`` (a process group of its own); past
    ``limit`` seconds its whole process group is killed and the test fails."""
    try:
        out, err = proc.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"job did not end within {limit} s\n{out[-3000:]}\n{err[-3000:]}")
    return proc.returncode, out, err


def kill_at(proc, victim: int, step: int, limit: float) -> str:
    """Read the job's output (``--announce``: ``rank R pid P`` lines, then ``step S ...`` as
    rank 0 finishes each step) until step ``step``, then SIGKILL rank ``victim``; the output
    read so far."""
    pids, lines = {}, []
    deadline = time.monotonic() + limit
    for line in proc.stdout:
        lines.append(line)
        w = line.split()
        if len(w) == 4 and w[0] == "rank" and w[2] == "pid":
            pids[int(w[1])] = int(w[3])
        if len(w) == 6 and w[0] == "step" and int(w[1]) == step:
            os.kill(pids[victim], signal.SIGKILL)
            break
        assert time.monotonic() < deadline, f"step {step} not reached within {limit} s"
    return "".join(lines)
