"""Run documented commands one after another inside one MPI job (tests/test_docs.py).

    mpiexec -n 2 python tests/docs_runner.py COMMANDS.json RESULTS.jsonl

``COMMANDS.json`` is a list of ``{"id", "cwd", "env", "argv"}``: ``argv`` is what follows
``python`` (``["-m", "bench", "allreduce", ...]`` or ``["script.py", ...]``), ``env`` the
settings the command line sets. Each runs in this process on every rank, as ``python -m`` or
``python script.py`` would run it (``runpy``, ``sys.argv``, the folder, the environment), so the
job pays for starting Python, MPI and torch once instead of once per command. An exception, or
an exit status other than 0, is that command's failure; the ranks then agree on the verdict and
rank 0 appends one line per command to ``RESULTS.jsonl`` (``id``, ``ok``, the tail of what it
printed, the error), so that a job that dies midway still says which commands ran. What one
command leaves behind that another would trip on (a torch process group, a changed setting,
the exception hook) is undone after it.
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import runpy
import sys
import traceback

__all__ = ["run_one", "main"]


def run_one(argv: list[str], env: dict, cwd: str) -> tuple[bool, str, str]:
    """Run one command here; (ok, what it printed, the error or "")."""
    from collectives import config
    saved_env, saved_argv, saved_hook = dict(os.environ), list(sys.argv), sys.excepthook
    saved_cwd = os.getcwd()
    out = io.StringIO()
    ok, error = True, ""
    try:
        os.environ.update(env)
        config.reload()
        os.chdir(cwd)
        with contextlib.redirect_stdout(out):
            if argv[:2] == ["-m", "bench"]:
                from bench.__main__ import main as bench_main
                sys.argv = ["bench"] + argv[2:]
                code = bench_main(argv[2:])
            else:
                sys.argv = list(argv)
                runpy.run_path(argv[0], run_name="__main__")
                code = 0
        if code:
            ok, error = False, f"exit status {code}"
    except SystemExit as exc:
        if exc.code not in (0, None):
            ok, error = False, f"SystemExit: {exc.code}"
    except BaseException:  # noqa: BLE001 - any failure is the command's, reported
        ok, error = False, traceback.format_exc()
    finally:
        os.chdir(saved_cwd)
        os.environ.clear()
        os.environ.update(saved_env)
        config.reload()
        sys.argv, sys.excepthook = saved_argv, saved_hook
        _close_torch()
    return ok, out.getvalue(), error


def _close_torch() -> None:
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def main() -> int:
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    commands = json.loads(open(sys.argv[1]).read())
    results = sys.argv[2]
    for cmd in commands:
        ok, printed, error = run_one(cmd["argv"], cmd["env"], cmd["cwd"])
        verdicts = comm.gather((ok, printed, error), root=0)
        comm.Barrier()
        if comm.Get_rank() == 0:
            errors = [f"rank {r}: {e}" for r, (_, _, e) in enumerate(verdicts) if e]
            line = {"id": cmd["id"], "ok": all(v[0] for v in verdicts),
                    "printed": printed[-3000:], "error": "\n".join(errors)[-4000:]}
            with open(results, "a") as f:
                f.write(json.dumps(line) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
