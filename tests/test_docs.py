"""Every command that README.md and docs/*.md show runs, as a new user would run it, at its
smallest sizes.

The commands are read from the documents themselves, so a changed command is tested as written:
every line of a ```sh block (a line ending in ``\\`` continues; a ``for ... done`` block is one
command), and an inline ``mpiexec -n N python FILE.py`` that runs a snippet of the same
document. A snippet is a ```python block whose paragraph names the file (``Save this as
`allreduce_demo.py```); it is written to the document's folder first. Each command is set to
one rank count (``mpiexec -n 2``), shrunk by ``SHRINK`` (sizes, rounds, epochs, steps: an option
given is set, one missing is added; a loop runs its first value), and ``SKIP`` lists what is not
run and why (a GPU, an installation, the suite itself).

Started one by one, the commands would spend most of a minute each on a loaded machine starting
Python, MPI and torch; so one ``mpiexec -n 2`` job runs them all in order
(tests/docs_runner.py): each as ``python -m``/``python script.py`` would run it (``runpy``,
``sys.argv``, its settings, the document's folder, with ``examples`` and ``tests`` linked there
and ``XDG_CACHE_HOME`` inside it, so that ``tune`` and ``calibrate`` write nothing outside).
The test launches its own ``mpiexec`` job: it runs in the in-process tier and is skipped under
``mpiexec``, as tests/test_examples.py.
"""
from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
DOCS = [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))
UNDER_MPI = any(k in os.environ for k in ("PMI_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE"))
RANKS = 2  # every mpiexec command runs at this rank count
LIMIT = 90  # seconds per command

# Commands not run, by a pattern of their text, and why.
SKIP = [
    (r"^make\b", "creates .venv and installs into it (make demo runs the commands shown "
                 "beside it; make test is this suite)"),
    (r"-m pytest\b", "the test suite itself"),
    (r"-m bench fsdp\b", "launches its own mpiexec jobs: pairs of FSDP2 training runs, minutes"),
    (r"-m bench wall\b", "launches its own mpiexec jobs, on a rate-limited network namespace "
                          "(root): minutes of training; tests/test_bench_wall.py runs a small "
                          "study on shared memory"),
    (r"-m bench net\b", "needs root and starts its own mpiexec job in a network namespace "
                         "(tests/test_bench_net.py runs bench net)"),
    (r"-m bench cluster\b", "needs root and builds hosts in network namespaces, then launches "
                             "its own job (tests/test_bench_cluster.py runs bench cluster)"),
    (r"-m bench docs(?! --list)", "reruns the documentation's sample commands: minutes of "
                                  "benchmarks (--list shows them)"),
    (r"^bash tests/gpu/", "needs a GPU machine"),
    (r"\.venv-ompi|^export OMPI_|pip install", "installs packages from the network"),
]

# What each program is shrunk to: option -> value (set where given, added where not). Keys are
# matched against the program a command runs: "bench <command>" or the script's path.
_SIZES = {"-b": "4K", "-e": "4K", "--rounds": "1"}
SHRINK = {
    "bench allreduce": _SIZES, "bench reduce_scatter": _SIZES, "bench allgather": _SIZES,
    "bench broadcast": _SIZES, "bench reduce": _SIZES, "bench alltoall": _SIZES,
    "bench gather": _SIZES, "bench scatter": _SIZES, "bench $c": _SIZES,
    "bench tune": {"--collectives": "allreduce", "-b": "8", "-e": "64", "-f": "8",
                   "--rounds": "1"},
    "bench overhead": {"--sizes": "8", "--rounds": "1", "--calls": "10"},
    "bench memory": {"--calls": "20", "--warmup": "5", "--bytes": "4K"},
    "bench ddp": {"--rounds": "1", "--steps": "1", "--warmup": "1"},
    "bench zero": {"--rounds": "1", "--steps": "1"},
    "bench elastic": {"--params-m": "0.5", "--rounds": "1", "--steps": "2", "--every": "1,2"},
    "bench pipeline": {"--microbatches": "2", "--steps": "1", "--warmup": "1"},
    "bench model --validate": {"-b": "8", "-e": "8", "--rounds": "1"},
    "bench -h": {}, "bench calibrate": {},  # help; a few seconds of ping-pongs
    "bench docs": {},  # --list only (SKIP)
    # thousands of simulated ranks take minutes; the same code paths at 64
    "bench model": {"--ranks": "64", "--bytes": "1M"},
    "examples/train_ddp.py": {"--epochs": "1", "--samples": "384", "--no-progress": None},
    "examples/train_numpy.py": {"--epochs": "1", "--samples": "600"},
    "examples/train_moe.py": {"--epochs": "1", "--steps": "2"},
    "examples/train_fsdp.py": {"--steps": "2"},
    "examples/train_zero.py": {"--epochs": "1", "--samples": "384"},
    "tests/faults/cost.py": {"#args": "20 1"},
}


@dataclass(frozen=True)
class Command:
    where: str   # document:line
    text: str    # as the document shows it
    doc: Path


def _blocks(text: str):
    """``(language, first line number, body)`` of every fenced block of ``text``."""
    for m in re.finditer(r"^```(\w*)\n(.*?)^```", text, re.S | re.M):
        yield m.group(1), text.count("\n", 0, m.start()) + 2, m.group(2)


def snippets(doc: Path) -> dict[str, str]:
    """The ```python blocks of ``doc`` that its text names a file for: {name: source}."""
    text = doc.read_text()
    found, last = {}, 0
    for m in re.finditer(r"^```python\n(.*?)^```", text, re.S | re.M):
        before = text[last:m.start()].strip().split("\n\n")[-1]  # the paragraph above
        names = re.findall(r"(?<![\w/.])([A-Za-z_]\w*\.py)\b", before)
        if names:
            found[names[-1]] = m.group(1)
        last = m.end()
    return found


def commands() -> list[Command]:
    """Every command of the documents (see the module's docstring)."""
    out = []
    for doc in DOCS:
        text = doc.read_text()
        name = doc.relative_to(ROOT).as_posix()
        for lang, line, body in _blocks(text):
            if lang not in ("sh", "bash", "shell"):
                continue
            if re.search(r"^\s*for .*; do", body, re.M):  # a loop: one script
                out.append(Command(f"{name}:{line}", _strip(body), doc))
                continue
            pending, start = "", line
            for i, raw in enumerate(body.splitlines()):
                if not pending:
                    start = line + i
                pending += raw.rstrip("\\").rstrip() + " " if raw.endswith("\\") else raw
                if raw.endswith("\\"):
                    continue
                cmd = _strip(pending)
                pending = ""
                if cmd and not cmd.startswith("#"):
                    out.append(Command(f"{name}:{start}", cmd, doc))
        for file in snippets(doc):
            for m in re.finditer(rf"`(mpiexec -n \d+ python {re.escape(file)})`", text):
                out.append(Command(f"{name}:{text.count(chr(10), 0, m.start()) + 1}",
                                   m.group(1), doc))
    return out


def _strip(cmd: str) -> str:
    """``cmd`` without its trailing comment (`` # ...`` after the command)."""
    lines = [re.sub(r"\s+#\s.*$", "", ln).rstrip() for ln in cmd.splitlines()]
    return "\n".join(ln for ln in lines if ln.strip()).strip()


def program(cmd: str) -> str | None:
    """The program a command runs: ``bench <command>`` (``bench model --validate`` apart) or
    a script's path; None for a shell construct."""
    m = re.search(r"python3? -m bench (\S+)", cmd)
    if m:
        return "bench model --validate" if m.group(1) == "model" and "--validate" in cmd \
            else f"bench {m.group(1)}"
    m = re.search(r"python3? (\S+\.py)\b", cmd)
    return m.group(1) if m else None


def _set(cmd: str, option: str, value: str | None) -> str:
    """``cmd`` with ``option`` set to ``value`` (a flag when None), replacing its value where
    ``cmd`` gives one."""
    pat = rf"(?<=\s){re.escape(option)}(?=\s|$)" + ("" if value is None else r"\s+\S+")
    new = option if value is None else f"{option} {value}"
    if re.search(pat, cmd):
        return re.sub(pat, new, cmd, count=1)
    # Added after the program's own arguments, before a redirection or the loop's end.
    m = re.search(r"\s*(?:[;|&>]|\n|$)", cmd[cmd.index(program(cmd) or "python"):])
    at = cmd.index(program(cmd) or "python") + m.start()
    return f"{cmd[:at]} {new}{cmd[at:]}"


def shrink(cmd: str) -> str:
    """``cmd`` at ``RANKS`` ranks and its smallest sizes (``SHRINK``)."""
    cmd = re.sub(r"(mpiexec(?: --?[\w-]+)*) -n \S+", rf"\1 -n {RANKS}", cmd)
    cmd = re.sub(r"\b(for \w+ in) (\S+)[^;\n]*;", r"\1 \2;", cmd)  # a loop's first value
    rules = SHRINK.get(program(cmd) or "", {})
    for option, value in rules.items():
        if option == "#args":  # positional arguments: replace what follows the script
            cmd = re.sub(rf"({re.escape(program(cmd))})(?: [^-\s]\S*)*", rf"\1 {value}", cmd)
        else:
            cmd = _set(cmd, option, value)
    return cmd


def skipped(cmd: str) -> str | None:
    return next((why for pat, why in SKIP if re.search(pat, cmd, re.M)), None)


ALL = commands()


def _cases():
    seen, cases = set(), []
    for c in ALL:
        run = shrink(c.text)
        same = re.sub(r"(--json|--csv|--plot) \S+", r"\1 FILE", run)  # one run per command
        if same in seen:
            continue
        seen.add(same)
        why = skipped(c.text)
        marks = [pytest.mark.skip(reason=why)] if why else []
        cases.append(pytest.param(c, run, id=c.where, marks=marks))
    return cases


# -- the extraction and the shrink rules ----------------------------------------------------------
def test_commands_are_found_in_every_kind_of_place():
    texts = [c.text for c in ALL]
    assert any(t.startswith("mpiexec -n 3 python examples/train_ddp.py") for t in texts)
    assert any("python -m bench model --validate" in t for t in texts)
    assert any(t.startswith("for n in") and t.endswith("done") for t in texts)
    assert "allreduce_demo.py" in snippets(ROOT / "README.md")
    assert all("  #" not in t for t in texts), [t for t in texts if "  #" in t]


def test_shrink_sets_or_adds_each_option():
    cmd = "mpiexec -n 3 python -m bench allreduce -b 8 -e 64M -f 4 --rounds 11 --plot busbw.png"
    assert shrink(cmd) == "mpiexec -n 2 python -m bench allreduce -b 4K -e 4K -f 4 " \
                          "--rounds 1 --plot busbw.png"
    assert shrink("mpiexec -n 2 python -m bench reduce_scatter --latency") == \
        "mpiexec -n 2 python -m bench reduce_scatter --latency -b 4K -e 4K --rounds 1"
    assert shrink("mpiexec -n 3 python examples/train_ddp.py --epochs 12 --hook H") == \
        "mpiexec -n 2 python examples/train_ddp.py --epochs 1 --hook H --samples 384 " \
        "--no-progress"
    assert shrink("for H in a b; do\n  mpiexec -n 3 python examples/train_ddp.py --hook $H\n"
                  "done") == "for H in a; do\n  mpiexec -n 2 python examples/train_ddp.py " \
                             "--hook $H --epochs 1 --samples 384 --no-progress\ndone"
    assert shrink("mpiexec -n 2 python tests/faults/cost.py 2000 9") == \
        "mpiexec -n 2 python tests/faults/cost.py 20 1"
    assert program("COLLECTIVES_X=1 mpiexec -n 2 python -m bench model --validate -b 1M") == \
        "bench model --validate"


def test_every_program_a_document_runs_has_shrink_rules_or_is_skipped():
    loose = {program(c.text) for c in ALL if not skipped(c.text)} - set(SHRINK) - {None}
    loose -= {f for doc in DOCS for f in snippets(doc)}  # the documents' own small snippets
    assert not loose, f"no shrink rule for {sorted(loose)}: add one to SHRINK"


# -- the sample outputs (python -m bench docs) ---------------------------------------------------
def test_every_sample_marker_is_closed_and_its_output_replaced():
    from bench import docs
    for doc in DOCS:
        text = doc.read_text()
        opened = re.findall(r"^<!-- sample: ", text, re.M)
        closed = re.findall(r"^<!-- /sample -->$", text, re.M)
        assert len(docs.samples(text)) == len(opened) == len(closed), doc
    text = "a\n<!-- sample: echo hi -->\n```\nold\n```\n<!-- /sample -->\nb\n"
    (sample,) = docs.samples(text)
    assert sample.command == "echo hi" and sample.line == 2
    assert docs.replace(text, sample, "new\n") == \
        "a\n<!-- sample: echo hi -->\n```\nnew\n```\n<!-- /sample -->\nb\n"
    assert docs.render("| a |\n| - |\n") == "| a |\n| - |\n"  # a table stays a table


def test_bench_docs_regenerates_a_sample(tmp_path):
    from bench import docs
    md = tmp_path / "x.md"
    md.write_text("<!-- sample: python -c 'print(6 * 7)' -->\n```\n1\n```\n<!-- /sample -->\n"
                  "<!-- sample: exit 3 -->\nkept\n<!-- /sample -->\n")
    assert docs.main([str(md)]) == 1  # the failing command leaves its sample as it was
    assert md.read_text() == "<!-- sample: python -c 'print(6 * 7)' -->\n```\n42\n```\n" \
                             "<!-- /sample -->\n<!-- sample: exit 3 -->\nkept\n<!-- /sample -->\n"


# -- running them ---------------------------------------------------------------------------------
def expand(cmd: str) -> list[str]:
    """The command lines ``cmd`` runs: a ``for V in a b; do ... done`` loop (as ``shrink``
    leaves it: one value per loop) becomes its body with ``$V`` replaced."""
    values = dict(re.findall(r"\bfor (\w+) in (\S+);\s*do\b", cmd))
    lines = []
    for line in cmd.splitlines():
        line = re.sub(r"\bfor \w+ in \S+;\s*do\b", "", line)
        line = re.sub(r"\bdone\b;?", "", line).strip()
        for name, value in values.items():
            line = re.sub(rf"\$(?:{name}\b|\{{{name}\}})", value, line)
        if line:
            lines.append(line)
    return lines


def invocation(line: str) -> tuple[dict, list[str]]:
    """``[VAR=value ...] [mpiexec [options] -n N] python ARGS`` -> (the settings, ARGS)."""
    words = shlex.split(line)
    env = {}
    while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", words[0]):
        name, _, value = words.pop(0).partition("=")
        env[name] = value
    if words and words[0] == "mpiexec":
        words = words[words.index(next(w for w in words if re.fullmatch(r"python3?", w))):]
    if not words or not re.fullmatch(r"python3?", words[0]) or \
            any(w in ("|", ";", "&&", ">", "<") for w in words):
        raise ValueError(f"not a python command: {line!r}")
    return env, words[1:]


def test_loops_and_settings_become_invocations():
    cmd = shrink("for n in 2 3; do for c in allreduce reduce; do\n"
                 "  mpiexec -n $n python -m bench $c -b 8 -e 64M --json $c-n$n.json\ndone; done")
    assert expand(cmd) == ["mpiexec -n 2 python -m bench allreduce -b 4K -e 4K "
                           "--json allreduce-n2.json --rounds 1"]
    assert invocation("COLLECTIVES_X=1 mpiexec --oversubscribe -n 2 python a.py --b 1") == \
        ({"COLLECTIVES_X": "1"}, ["a.py", "--b", "1"])
    with pytest.raises(ValueError):
        invocation("mpiexec -n 2 python a.py | tail")


_FOLDERS: dict = {}


def _folder(doc: Path, factory) -> Path:
    """The folder where ``doc``'s commands run, in the document's order (a command may read
    what one above it wrote: a tuning file), with its snippets and the repository's
    ``examples`` and ``tests``."""
    if doc not in _FOLDERS:
        path = factory.mktemp(doc.stem)
        for name, source in snippets(doc).items():
            (path / name).write_text(source)
        for folder in ("examples", "tests"):
            (path / folder).symlink_to(ROOT / folder)
        (path / "cache").mkdir()
        _FOLDERS[doc] = path
    return _FOLDERS[doc]


JOB_LIMIT = 480  # seconds for the one job that runs every command


@pytest.fixture(scope="module")
def job(tmp_path_factory) -> dict:
    """Every command not skipped, run in order by one ``mpiexec -n RANKS`` job
    (tests/docs_runner.py): {command id: its result}."""
    if UNDER_MPI:
        pytest.skip("launches its own mpiexec job: run the test without mpiexec")
    if not (BIN / "mpiexec").exists():
        pytest.skip("mpiexec not found beside the interpreter")
    todo = []
    for case in _cases():
        command, run = case.values
        if case.marks:
            continue
        cwd = _folder(command.doc, tmp_path_factory)
        for i, line in enumerate(expand(run)):
            env, argv = invocation(line)
            # tune and calibrate write under XDG_CACHE_HOME: the run's folder, not the user's
            env.setdefault("XDG_CACHE_HOME", str(cwd / "cache"))
            todo.append({"id": command.where, "cwd": str(cwd), "env": env, "argv": argv})
    work = tmp_path_factory.mktemp("docs-job")
    (work / "commands.json").write_text(json.dumps(todo))
    results = work / "results.jsonl"
    env = {k: v for k, v in os.environ.items() if not k.startswith("COLLECTIVES_")}
    # A rank left waiting by a failed peer is ended by the watchdog, the job by mpiexec.
    env.update(PATH=f"{BIN}{os.pathsep}{env.get('PATH', '')}", PYTHONUNBUFFERED="1",
               COLLECTIVES_TIMEOUT="120", MPIEXEC_TIMEOUT=str(JOB_LIMIT))
    done = subprocess.run([str(BIN / "mpiexec"), "-n", str(RANKS), sys.executable,
                           str(ROOT / "tests" / "docs_runner.py"), str(work / "commands.json"),
                           str(results)], env=env, cwd=work, capture_output=True, text=True,
                          timeout=JOB_LIMIT + 30)
    found: dict = {}
    if results.exists():
        for line in results.read_text().splitlines():
            r = json.loads(line)
            mine = found.setdefault(r["id"], {"ok": True, "printed": "", "error": ""})
            mine["ok"] &= r["ok"]
            mine["printed"] += r["printed"]
            mine["error"] += r["error"]
    found["#job"] = {"status": done.returncode,
                     "tail": (done.stdout[-3000:] + "\n" + done.stderr[-3000:]).strip()}
    return found


@pytest.mark.timeout(JOB_LIMIT + 60)
@pytest.mark.parametrize("command,run", _cases())
def test_documented_command_runs(command, run, job):
    result = job.get(command.where)
    assert result is not None, f"{command.where}: {run}\nnot run: the job ended before it " \
        f"(exit {job['#job']['status']})\n{job['#job']['tail']}"
    assert result["ok"], f"{command.where}: {run}\n{result['error']}\n{result['printed']}"
    assert result["printed"].strip(), f"{command.where}: {run}: printed nothing"
