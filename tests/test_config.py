"""Settings (``collectives.config``): the parsers, ``get``/``set``/``reload``, a clear
``ValueError`` for every bad value (in-process and from every rank of a real job), and the
README's settings table.

In-process: ``python -m pytest -m "not mpi" tests/test_config.py``. The job tests launch their
own ``mpiexec -n 2`` (as tests/test_faults.py does) and are skipped under ``mpiexec``.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import collectives as coll
from collectives import config, select
from test_faults import MPIEXEC, UNDER_MPI, Job

README = Path(__file__).resolve().parent.parent / "README.md"


@pytest.fixture
def environ(monkeypatch):
    """``environ(name, value)``: set an environment variable and read the settings again;
    afterwards the environment is restored and read again."""
    def put(name, value):
        monkeypatch.setenv(name, value)
        config.reload()

    yield put
    monkeypatch.undo()
    config.reload()


# -- the parsers -----------------------------------------------------------------------------
@pytest.mark.parametrize("text,value", [
    ("1", True), ("on", True), ("TRUE", True), (" yes ", True), (True, True),
    ("0", False), ("off", False), ("False", False), ("NO", False), (False, False)])
def test_parse_bool(text, value):
    assert config.parse_bool(text) is value


@pytest.mark.parametrize("text", ["", "2", "abc", "enabled", "y"])
def test_parse_bool_refuses(text):
    with pytest.raises(ValueError, match="1/0"):
        config.parse_bool(text)


def test_parse_auto_bool():
    assert config.parse_auto_bool("auto") is None and config.parse_auto_bool(" AUTO ") is None
    assert config.parse_auto_bool(None) is None
    assert config.parse_auto_bool("on") is True and config.parse_auto_bool("0") is False
    with pytest.raises(ValueError, match="auto"):
        config.parse_auto_bool("sometimes")


@pytest.mark.parametrize("text,value", [
    ("4096", 4096), ("0", 0), ("64K", 65536), ("64k", 65536), ("4M", 4 << 20),
    ("1MiB", 1 << 20), ("2G", 2 << 30), ("1T", 1 << 40), ("1.5K", 1536), (" 8 KB ", 8192),
    ("512B", 512), (123, 123)])
def test_parse_bytes(text, value):
    assert config.parse_bytes(text) == value


@pytest.mark.parametrize("text", ["", "abc", "-1", "4X", "K", "1e3", "4 M B"])
def test_parse_bytes_refuses(text):
    with pytest.raises(ValueError, match="byte count"):
        config.parse_bytes(text)


@pytest.mark.parametrize("text,value", [
    ("300", 300.0), ("2.5", 2.5), (".5", 0.5), ("500ms", 0.5), ("10s", 10.0), ("5m", 300.0),
    ("2min", 120.0), ("1h", 3600.0), ("0", 0.0), (7, 7.0), (0.25, 0.25)])
def test_parse_seconds(text, value):
    assert config.parse_seconds(text) == pytest.approx(value)


@pytest.mark.parametrize("text", ["", "abc", "-1", "soon", "nan", "5 days", "1d"])
def test_parse_seconds_refuses(text):
    with pytest.raises(ValueError):
        config.parse_seconds(text)
    with pytest.raises(ValueError, match=">= 0"):
        config.parse_seconds(-1.0)


# -- get, set, reload ------------------------------------------------------------------------
def test_defaults_are_what_the_declarations_say(monkeypatch):
    for name in config.SETTINGS:
        monkeypatch.delenv(name, raising=False)
    config.reload()
    try:
        for name, setting in config.SETTINGS.items():
            assert config.get(name) == setting.default, name
        assert config.get("COLLECTIVES_TIMEOUT") == 600.0
        assert config.get("COLLECTIVES_SEGMENT_BYTES") == 4 << 20
        assert config.get("COLLECTIVES_CHECK") is False
    finally:
        monkeypatch.undo()
        config.reload()


def test_get_reads_the_environment_once(environ):
    environ("COLLECTIVES_SEGMENT_BYTES", "64K")
    assert config.get("COLLECTIVES_SEGMENT_BYTES") == 65536
    os.environ["COLLECTIVES_SEGMENT_BYTES"] = "1M"  # not seen until reload
    assert config.get("COLLECTIVES_SEGMENT_BYTES") == 65536
    config.reload()
    assert config.get("COLLECTIVES_SEGMENT_BYTES") == 1 << 20
    environ("COLLECTIVES_SEGMENT_BYTES", "  ")  # blank: the default
    assert config.get("COLLECTIVES_SEGMENT_BYTES") == 4 << 20


def test_set_overrides_checks_and_returns_the_old_value(environ):
    environ("COLLECTIVES_TIMEOUT", "60")
    assert config.set("COLLECTIVES_TIMEOUT", "500ms") == 60.0
    assert config.get("COLLECTIVES_TIMEOUT") == 0.5
    with pytest.raises(ValueError, match=r"COLLECTIVES_TIMEOUT='abc'"):
        config.set("COLLECTIVES_TIMEOUT", "abc")
    assert config.get("COLLECTIVES_TIMEOUT") == 0.5  # a refused value changes nothing
    assert config.set("COLLECTIVES_TIMEOUT", None) == 0.5  # None: the default
    assert config.get("COLLECTIVES_TIMEOUT") == 600.0
    assert config.set("COLLECTIVES_SEGMENT_BYTES", 24) == 4 << 20  # typed values too
    assert config.set("COLLECTIVES_SEGMENT_BYTES", "1K") == 24
    config.reload()  # forgets what was set: the environment again
    assert config.get("COLLECTIVES_TIMEOUT") == 60.0
    assert config.get("COLLECTIVES_SEGMENT_BYTES") == 4 << 20


def test_current_is_get_through_set_and_reload(environ):
    """``config.current.NAME`` is ``get(NAME)`` after every set and reload, and ``validated``
    says whether every setting was read since the last change."""
    environ("COLLECTIVES_TIMEOUT", "60")
    assert config.current.COLLECTIVES_TIMEOUT == 60.0 and not config.validated
    config.set("COLLECTIVES_TIMEOUT", "500ms")
    assert config.current.COLLECTIVES_TIMEOUT == 0.5 == config.get("COLLECTIVES_TIMEOUT")
    assert config.validate() and config.validated
    config.set("COLLECTIVES_CHECK", "1")
    assert not config.validated and config.current.COLLECTIVES_CHECK is True
    config.reload()
    assert config.current.COLLECTIVES_TIMEOUT == 60.0 and config.current.COLLECTIVES_CHECK is False
    with pytest.raises(KeyError, match="unknown setting"):
        config.current.COLLECTIVES_NO_SUCH
    with pytest.raises(AttributeError):
        config.current.__wrapped__


def test_unknown_setting_is_a_key_error_listing_the_settings():
    for call in (lambda: config.get("COLLECTIVES_NOPE"),
                 lambda: config.set("COLLECTIVES_NOPE", 1)):
        with pytest.raises(KeyError, match="COLLECTIVES_TIMEOUT"):
            call()


def test_set_through_the_watchdog_and_the_executor():
    from collectives import executor, watchdog
    old = watchdog.set_timeout(12)
    try:
        assert config.get("COLLECTIVES_TIMEOUT") == 12 and watchdog.timeout() == 12
    finally:
        watchdog.set_timeout(old)
    old = config.set("COLLECTIVES_SEGMENT_BYTES", "64")
    try:
        assert executor.segment_elems(4) == 16 and executor.segment_elems(128) == 1
    finally:
        config.set("COLLECTIVES_SEGMENT_BYTES", old)


# -- every setting's bad values --------------------------------------------------------------
# name -> values refused at first use. Every setting is here but the two file paths, whose
# files are read by their users (COLLECTIVES_TUNING: select.load_table, below).
BAD = {
    "COLLECTIVES_CHECK": ["abc", "2"],
    "COLLECTIVES_TIMEOUT": ["abc", "-1", "5 days"],
    "COLLECTIVES_STALL_WARNING": ["soon", "-5"],
    "COLLECTIVES_ABORT_ON_EXCEPTION": ["maybe", "2"],
    "COLLECTIVES_RANKS_PER_NODE": ["abc", "0", "-2", "1.5"],
    "COLLECTIVES_RANKS_PER_NUMA": ["abc", "0"],
    "COLLECTIVES_SEGMENT_BYTES": ["abc", "0", "-4"],
    "COLLECTIVES_PROGRESS_THREAD": ["abc", "2"],
    "COLLECTIVES_WAIT": ["abc", "fast"],
    "COLLECTIVES_SHM_CHUNK_BYTES": ["abc", "0", "63"],
    "COLLECTIVES_SHM_WHOLE_BYTES": ["abc", "-1"],
    "COLLECTIVES_SHM_CMA": ["abc"],
    "COLLECTIVES_SHM_SPIN": ["abc", "-1"],
    "COLLECTIVES_CUDA_AWARE": ["abc"],
    "COLLECTIVES_PINNED_CACHE_BYTES": ["abc", "1X"],
}
PATHS = ("COLLECTIVES_TUNING", "COLLECTIVES_COST_MODEL", "COLLECTIVES_TIMELINE")


def test_every_setting_has_bad_values_here():
    assert set(BAD) | set(PATHS) == set(config.SETTINGS), \
        "a setting was added or removed: list its bad values in BAD"


@pytest.mark.parametrize("name,value", [(n, v) for n, vs in BAD.items() for v in vs])
def test_a_bad_value_is_a_value_error_naming_the_variable(name, value, environ):
    environ(name, value)  # read at first use, not now
    with pytest.raises(ValueError) as info:
        config.get(name)
    message = str(info.value)
    assert f"{name}={value!r}" in message, message
    assert config.SETTINGS[name].accepts in message, message
    with pytest.raises(ValueError, match=re.escape(f"{name}={value!r}")):
        config.set(name, value)


@pytest.mark.parametrize("name", PATHS)
def test_a_path_setting_takes_any_path(name, environ, tmp_path):
    missing = tmp_path / "missing.json"
    environ(name, str(missing))
    assert config.get(name) == str(missing)
    environ(name, "~/x.json")
    assert config.get(name) == os.path.expanduser("~/x.json")


def test_a_bad_check_setting_fails_the_first_call(environ):
    environ("COLLECTIVES_CHECK", "abc")
    x = np.ones(4)
    with pytest.raises(ValueError, match="COLLECTIVES_CHECK='abc'"):
        coll.allreduce(x)
    assert (x == 1).all()


def _auto_call():
    return coll.allreduce(np.ones(4, np.float32))  # algorithm="auto": reads the table


def _ring_call():
    return coll.allreduce(np.ones(4, np.float32), algorithm="ring")


def test_a_missing_tuning_file_fails_the_first_call(environ, tmp_path, capsys):
    """The first call after the settings were (re)read checks them all, the tuning file too,
    even where it names its algorithm; every later auto call still needs the table."""
    missing = tmp_path / "nope.json"
    said = re.escape(f"COLLECTIVES_TUNING={str(missing)!r}")
    for first in (_ring_call, _auto_call):
        environ("COLLECTIVES_TUNING", str(missing))
        with pytest.raises(ValueError, match=said):
            first()
        assert re.search(r"\[collectives\] rank 0 of 1: ValueError: " + said,
                         capsys.readouterr().err)
        with pytest.raises(ValueError, match=said):
            _auto_call()
        with pytest.raises(ValueError, match=said):
            select.load_table()


@pytest.mark.parametrize("text", ["not json {", json.dumps({"version": 1}),
                                  json.dumps({"tables": {"allreduce": {"2": [[None, "nope"]]}}}),
                                  json.dumps({"tables": {"nope": {"2": [[None, "ring"]]}}}),
                                  json.dumps({"tables": {"allreduce": {"2": [["4K", "ring"]]}}}),
                                  # registered buffers only: auto takes it by agreement
                                  json.dumps({"tables": {"allreduce":
                                                         {"2": [[None, "onepass"]]}}})])
def test_a_bad_tuning_file_fails_the_first_auto_call(text, environ, tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(text)
    environ("COLLECTIVES_TUNING", str(bad))
    with pytest.raises(ValueError, match=re.escape(f"COLLECTIVES_TUNING={str(bad)!r}")):
        _auto_call()


def test_a_good_tuning_file_is_read(environ, tmp_path):
    good = tmp_path / "good.json"
    good.write_text(json.dumps({"version": 1, "tables": {
        "allreduce": {"default": [[None, "tree"]], "2": [[None, "tree"]]}}}))
    environ("COLLECTIVES_TUNING", str(good))
    assert select.auto("allreduce", 1 << 20, 2) == "tree"
    # the file's rules are laid over the default table's: 3 ranks (and more) keep theirs
    default = next(name for limit, name in select.DEFAULT_TABLE["allreduce"]["3"]
                   if limit is None or limit >= 1 << 20)
    assert select.auto("allreduce", 1 << 20, 3) == default
    assert select.auto("allreduce", 1 << 20, 7) == default
    assert _auto_call() is not None


# -- the same from every rank of a real job --------------------------------------------------
CALL = "import numpy, collectives; collectives.allreduce(numpy.ones(4))"


def job(env: dict, n: int = 2, limit: float = 60) -> Job:
    """``mpiexec -n n python -c CALL`` with ``env`` over an environment free of COLLECTIVES_*
    (as tests/test_faults.py's ``launch``)."""
    if MPIEXEC is None:
        pytest.skip("mpiexec not found")
    if UNDER_MPI:
        pytest.skip("launches its own mpiexec jobs: run the test without mpiexec")
    full = {k: v for k, v in os.environ.items() if not k.startswith("COLLECTIVES_")}
    full.update(env, MPIEXEC_TIMEOUT=str(int(limit) + 15), PYTHONUNBUFFERED="1")
    start = time.monotonic()
    try:
        proc = subprocess.run([MPIEXEC, "-n", str(n), sys.executable, "-c", CALL],
                              capture_output=True, text=True, env=full, timeout=limit)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"still running after {limit} s: a hang\n{exc.stdout}\n{exc.stderr}")
    return Job(proc.returncode, proc.stdout, proc.stderr, time.monotonic() - start)


def _fails_on_every_rank(result: Job, name: str) -> None:
    assert result.rc != 0, result
    assert result.seconds < 30, result
    errors = re.findall(rf"ValueError: {name}=", result.text)
    assert len(errors) >= 2, result  # each rank's traceback


def test_a_bad_timeout_fails_every_rank_of_a_job():
    _fails_on_every_rank(job({"COLLECTIVES_TIMEOUT": "abc"}), "COLLECTIVES_TIMEOUT")


def test_a_missing_tuning_file_fails_every_rank_of_a_job(tmp_path):
    result = job({"COLLECTIVES_TUNING": str(tmp_path / "nope.json")})
    _fails_on_every_rank(result, "COLLECTIVES_TUNING")


def test_a_tuning_file_that_is_not_json_fails_every_rank_of_a_job(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("not json {")
    _fails_on_every_rank(job({"COLLECTIVES_TUNING": str(bad)}), "COLLECTIVES_TUNING")


# -- the README ------------------------------------------------------------------------------
def test_the_readme_settings_table_is_config_table():
    """The Markdown table under the README's ``## Settings`` is ``config.table()``, line for
    line (paste ``python -c "from collectives import config; print(config.table())"``)."""
    lines = README.read_text().splitlines()
    assert "## Settings" in lines, "README.md has no '## Settings' heading"
    start = lines.index("## Settings") + 1
    end = next((i for i in range(start, len(lines)) if lines[i].startswith("## ")), len(lines))
    section = lines[start:end]
    first = next((i for i, line in enumerate(section) if line.startswith("|")), None)
    assert first is not None, "no table under '## Settings'"
    table = []
    for line in section[first:]:
        if not line.startswith("|"):
            break
        table.append(line.rstrip())
    want = config.table().splitlines()
    for k, (got, expected) in enumerate(zip(table, want)):
        assert got == expected, f"README settings table, line {k + 1}"
    assert len(table) == len(want), f"README settings table: {len(table)} lines, " \
                                    f"config.table() {len(want)}"


def test_single_node_algorithms_across_nodes(environ, tmp_path):
    """A rule naming shm runs its hierarchical counterpart where the ranks span nodes, and the
    part across nodes alone where every node holds one rank (no shared window to set up)."""
    table = tmp_path / "shm.json"
    table.write_text(json.dumps({"version": 1, "tables": {
        "allreduce": {"default": [[None, "shm"]], select.MULTI: {"default": [[None, "shm"]]}},
        "reduce": {"default": [[None, "shm"]]}}}))
    environ("COLLECTIVES_TUNING", str(table))
    assert select.auto("allreduce", 1 << 20, 3) == "shm"
    assert select.auto("allreduce", 1 << 20, 3, single_node=False) == "hierarchical_shm"
    assert select.auto("allreduce", 1 << 20, 3, single_node=False, alone=True) == "ring"
    asked = []
    assert select.auto("allreduce", 1 << 20, 3, single_node=True,
                       alone=lambda: asked.append(1) or True) == "shm" and not asked
    assert select.auto("reduce", 1 << 20, 3, single_node=False, alone=True) == "native"
