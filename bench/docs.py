"""``python -m bench docs [FILE.md ...]``: regenerate the sample outputs in the documentation
from the commands that produce them.

A sample is marked in the Markdown source, around the output it shows::

    <!-- sample: mpiexec -n 2 python -m bench allreduce -b 8M -e 8M --rounds 5 -->
    ```
    ...what the command printed...
    ```
    <!-- /sample -->

The command runs through ``bash`` (so a pipe or a loop is part of it), with this interpreter's
``python`` and ``mpiexec`` first on ``PATH``, in a scratch folder where ``examples`` and
``tests`` are the repository's, and with no ``COLLECTIVES_*`` setting but those the command sets
itself. What it prints on stdout replaces the text between the markers: a Markdown table as it
is when every line is a table row, else a fenced block. A command that fails leaves its sample
as it was and makes the run exit 1. Without files: README.md and every docs/*.md of the
checkout. ``--list`` prints the samples without running them; ``--only TEXT`` runs those whose
command contains TEXT. The figures are whatever this machine measures when it runs.
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Sample", "samples", "render", "replace", "run", "main"]

ROOT = Path(__file__).resolve().parent.parent
_MARK = re.compile(r"^<!-- sample: (?P<cmd>.+?) -->\n(?P<body>.*?)^<!-- /sample -->$",
                   re.S | re.M)


@dataclass(frozen=True)
class Sample:
    """One marked sample: its command and where its output sits in the file's text."""
    command: str
    start: int   # offset of the output's first character
    end: int     # offset of the closing marker
    line: int    # line of the opening marker


def samples(text: str) -> list[Sample]:
    """Every marked sample of a Markdown ``text``, in order."""
    return [Sample(m.group("cmd").strip(), m.start("body"), m.end("body"),
                   text.count("\n", 0, m.start()) + 1) for m in _MARK.finditer(text)]


def render(output: str) -> str:
    """A command's stdout as the sample's text: a table as is, anything else fenced."""
    lines = output.rstrip("\n").splitlines()
    if lines and all(ln.startswith("|") for ln in lines):
        return "\n".join(lines) + "\n"
    return "```\n" + "\n".join(lines) + "\n```\n"


def replace(text: str, sample: Sample, output: str) -> str:
    """``text`` with ``sample``'s output replaced by ``output`` (rendered)."""
    return text[:sample.start] + render(output) + text[sample.end:]


def run(command: str, timeout: float | None = None) -> subprocess.CompletedProcess:
    """Run ``command`` as the module's docstring says; stdout and stderr captured."""
    bin_dir = Path(sys.executable).parent
    env = {k: v for k, v in os.environ.items() if not k.startswith("COLLECTIVES_")}
    env.update(PATH=f"{bin_dir}{os.pathsep}{env.get('PATH', '')}", PYTHONUNBUFFERED="1")
    with tempfile.TemporaryDirectory(prefix="bench-docs-") as tmp:
        for folder in ("examples", "tests"):
            os.symlink(ROOT / folder, Path(tmp) / folder)
        return subprocess.run(["bash", "-e", "-o", "pipefail", "-c", command], cwd=tmp,
                              env=env, capture_output=True, text=True, timeout=timeout)


def main(argv=None) -> int:
    """``python -m bench docs [FILE.md ...] [--list] [--only TEXT]``."""
    p = argparse.ArgumentParser(prog="python -m bench docs",
                                description="regenerate the documentation's sample outputs "
                                            "from their commands")
    p.add_argument("files", nargs="*", help="Markdown files (default: README.md, docs/*.md)")
    p.add_argument("--list", action="store_true", help="list the samples, run nothing")
    p.add_argument("--only", default=None, help="only samples whose command contains this")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per command (1800)")
    args = p.parse_args(argv)
    files = [Path(f) for f in args.files] or \
        [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))
    failed = 0
    for path in files:
        text = path.read_text()
        for i in range(len(samples(text))):
            sample = samples(text)[i]  # found again: the samples above may have grown
            if args.only and args.only not in sample.command:
                continue
            where = f"{path}:{sample.line}"
            if args.list:
                print(f"{where}: {sample.command}")
                continue
            print(f"{where}: running {sample.command}", flush=True)
            done = run(sample.command, args.timeout)
            if done.returncode != 0:
                failed += 1
                print(f"{where}: exit {done.returncode}, sample left as it was\n"
                      f"{done.stdout[-2000:]}{done.stderr[-2000:]}", file=sys.stderr)
                continue
            # Read again: the file may have been edited while the command ran.
            text = path.read_text()
            same = [s for s in samples(text) if s.command == sample.command]
            nth = [s for s in samples(text)[:i + 1] if s.command == sample.command]
            if not same or len(nth) > len(same):
                failed += 1
                print(f"{where}: the sample moved while its command ran; run again",
                      file=sys.stderr)
                continue
            text = replace(text, same[len(nth) - 1], done.stdout)
            path.write_text(text)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
