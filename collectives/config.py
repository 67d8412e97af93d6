"""Every ``COLLECTIVES_*`` setting: declared once here, parsed once, validated with clear errors.

A setting is read from the environment the first time it is asked for (``get``) and kept; a bad
value is a ``ValueError`` naming the variable, the value and what is accepted, raised at that
first use, on every rank alike (every rank has the same environment under ``mpiexec``).
``set`` overrides a setting for the rest of the process (tests, programs that tune themselves);
``reload`` forgets what was read and set, so that the next ``get`` reads the environment again.

    from collectives import config
    config.get("COLLECTIVES_TIMEOUT")       # 600.0
    old = config.set("COLLECTIVES_SEGMENT_BYTES", "64K")
    config.reload()                         # after changing os.environ mid-run
    config.current.COLLECTIVES_TIMEOUT      # get's value as an attribute, for per-call paths

The README's settings table is ``table()``; a test checks that the two agree.
"""
from __future__ import annotations

import os
import re
import threading
from dataclasses import dataclass
from typing import Any, Callable

__all__ = ["Setting", "SETTINGS", "get", "current", "set", "validate", "validated", "reload",
           "table", "parse_bool", "parse_bytes",
           "parse_seconds", "ON_WORDS", "OFF_WORDS"]

ON_WORDS = ("1", "true", "yes", "on")
OFF_WORDS = ("0", "false", "no", "off")


# -- the shared parsers: text (or an already typed value) -> value, ValueError saying why not ---
def parse_bool(value) -> bool:
    """``1/0/on/off/true/false/yes/no`` in any case, or a bool."""
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ON_WORDS:
        return True
    if text in OFF_WORDS:
        return False
    raise ValueError("expected one of 1/0, on/off, true/false, yes/no")


def parse_auto_bool(value) -> bool | None:
    """``auto`` (None) or a boolean."""
    if value is None or (isinstance(value, str) and value.strip().lower() == "auto"):
        return None
    try:
        return parse_bool(value)
    except ValueError:
        raise ValueError("expected auto, or one of 1/0, on/off, true/false, yes/no") from None


_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(?:i?b)?\s*$", re.IGNORECASE)


def parse_bytes(value) -> int:
    """A byte count: ``4096``, ``64K``, ``4M``, ``1MiB``, ``2G`` (binary units)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    match = _SIZE.match(str(value))
    if match is None:
        raise ValueError("expected a byte count such as 4096, 64K, 4M or 1G")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


_TIME = re.compile(r"^\s*(\d+(?:\.\d+)?|\.\d+)\s*(ms|s|m|min|h)?\s*$", re.IGNORECASE)
_SECONDS = {None: 1.0, "ms": 1e-3, "s": 1.0, "m": 60.0, "min": 60.0, "h": 3600.0}


def parse_seconds(value) -> float:
    """A duration: ``300``, ``2.5``, ``500ms``, ``10s``, ``5m``, ``1h``."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        seconds = float(value)
    else:
        match = _TIME.match(str(value))
        if match is None:
            raise ValueError("expected seconds such as 300, 2.5, 500ms, 10s or 5m")
        unit = match.group(2).lower() if match.group(2) else None
        seconds = float(match.group(1)) * _SECONDS[unit]
    if not seconds >= 0:
        raise ValueError("expected a duration >= 0")
    return seconds


def _at_least(parse, low):
    def check(value):
        parsed = parse(value)
        if parsed < low:
            raise ValueError(f"expected at least {low}")
        return parsed
    return check


def _int(value) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    try:
        return int(str(value).strip())
    except ValueError:
        raise ValueError("expected an integer") from None


def _choice(*words):
    def check(value):
        text = str(value).strip().lower()
        if text not in words:
            raise ValueError(f"expected one of {', '.join(words)}")
        return text
    return check


def _path(value):
    text = os.fspath(value).strip() if not isinstance(value, str) else value.strip()
    if not text:
        raise ValueError("expected a file path")
    return os.path.expanduser(text)


# -- the declarations -----------------------------------------------------------------------
@dataclass(frozen=True)
class Setting:
    """One ``COLLECTIVES_*`` variable: its parser, its default and what it means."""

    name: str
    parse: Callable[[Any], Any]
    default: Any          # the parsed value when the variable is unset (None: unset)
    shown: str            # the default as the settings table prints it
    accepts: str          # what values are accepted, in words
    meaning: str


SETTINGS: dict[str, Setting] = {s.name: s for s in (
    Setting("COLLECTIVES_CHECK", parse_bool, False, "off", "on/off",
            "compare every call's arguments across ranks (one small allreduce per call); a "
            "mismatch is a `MismatchError` on every rank"),
    Setting("COLLECTIVES_TIMEOUT", parse_seconds, 600.0, "600", "seconds (0: never)",
            "abort the job when a collective has not completed in this time, printing what each "
            "rank waits for"),
    Setting("COLLECTIVES_STALL_WARNING", parse_seconds, 60.0, "60", "seconds (0: never)",
            "warn when a collective has not completed in this time, and again at this interval, "
            "printing what each rank waits for"),
    Setting("COLLECTIVES_ABORT_ON_EXCEPTION", parse_bool, True, "on", "on/off",
            "an exception that no code catches, on any rank of a job of several ranks, aborts "
            "the whole job (as `python -m mpi4py` does); off for programs that handle it"),
    Setting("COLLECTIVES_TUNING", _path, None, "~/.cache/collectives/tuning.json if present",
            "a file path", "the tuning table `auto` reads (written by `python -m bench tune`); "
            "a named file must exist and parse"),
    Setting("COLLECTIVES_RANKS_PER_NODE", _at_least(_int, 1), None, "(the real nodes)",
            "ranks >= 1", "simulate nodes of this many consecutive ranks"),
    Setting("COLLECTIVES_RANKS_PER_NUMA", _at_least(_int, 1), None, "(the real NUMA domains)",
            "ranks >= 1", "simulate NUMA domains of this many consecutive ranks"),
    Setting("COLLECTIVES_SEGMENT_BYTES", _at_least(parse_bytes, 1), 4 << 20, "4M", "bytes",
            "the largest message a schedule sends; longer chunks go as several segments"),
    Setting("COLLECTIVES_PROGRESS_THREAD", parse_auto_bool, None, "auto", "auto/on/off",
            "drive non-blocking collectives from a background thread (auto: where the node has "
            "a core to spare)"),
    Setting("COLLECTIVES_WAIT", _choice("auto", "yield", "poll", "spin", "block"), "auto",
            "auto", "auto/yield/spin", "how a rank waits for a message: yield the core between "
            "polls or spin inside MPI (auto: yield where ranks fill the node's cores)"),
    Setting("COLLECTIVES_SHM_CHUNK_BYTES", _at_least(parse_bytes, 64), 1 << 20, "1M", "bytes",
            "`shm`'s round size per rank"),
    Setting("COLLECTIVES_SHM_WHOLE_BYTES", parse_bytes, None, "128K at 2 ranks, 512K above",
            "bytes", "`shm` allreduces up to this size reduce whole rounds on every rank"),
    Setting("COLLECTIVES_SHM_CMA", parse_bool, True, "on", "on/off",
            "`shm` all-gather and broadcast read peers' memory directly (`process_vm_readv`) "
            "where the kernel allows it"),
    Setting("COLLECTIVES_SHM_SPIN", _at_least(_int, 0), 200, "200", "polls >= 0",
            "polls an idle `shm` rank makes before it yields its core"),
    Setting("COLLECTIVES_CUDA_AWARE", parse_auto_bool, None, "auto", "auto/on/off",
            "hand device pointers to MPI (auto: detected from the MPI library)"),
    Setting("COLLECTIVES_PINNED_CACHE_BYTES", parse_bytes, 1 << 30, "1G", "bytes",
            "pinned host memory kept for staging device buffers"),
    Setting("COLLECTIVES_TIMELINE", _path, None, "(off)", "a file path",
            "write a Chrome trace of every collective, DDP bucket and training phase to this "
            "file (rank r: `.r` before the suffix, or `{rank}` in the path), at exit"),
    Setting("COLLECTIVES_COST_MODEL", _path, None, "~/.cache/collectives/costmodel.json",
            "a file path", "the calibrated cost model (`python -m bench calibrate` writes it); a "
            "named file must exist and parse where a model is read"),
)}

_values: dict[str, Any] = {}
validated = False  # every setting read and checked since the last set or reload (``validate``)
_lock = threading.Lock()


def _parse(setting: Setting, value):
    try:
        return setting.parse(value)
    except ValueError as exc:
        raise ValueError(f"{setting.name}={value!r}: {exc} ({setting.accepts})") from None


def _setting(name: str) -> Setting:
    try:
        return SETTINGS[name]
    except KeyError:
        raise KeyError(f"unknown setting {name!r}; the settings are "
                       f"{', '.join(SETTINGS)}") from None


def get(name: str):
    """The value of setting ``name``: set, else from the environment (read once), else the
    default."""
    try:
        return _values[name]
    except KeyError:
        pass
    setting = _setting(name)
    raw = os.environ.get(name)
    value = setting.default if raw is None or not raw.strip() else _parse(setting, raw)
    with _lock:
        return _values.setdefault(name, value)


class _Current:
    """Every setting's value as an attribute, ``config.current.COLLECTIVES_CHECK``: ``get``'s
    value, kept as an attribute until ``set`` or ``reload`` changes it. For the paths that run
    on every call: reading an attribute costs a third of calling ``get``."""

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        value = get(name)
        with _lock:
            if _values.get(name, _current_unset) is value:  # not set again meanwhile
                self.__dict__[name] = value
        return value


_current_unset = object()
current = _Current()


def set(name: str, value):  # noqa: A001 - config.set reads as what it does
    """Override setting ``name`` for the rest of the process (text or a typed value, checked
    like the environment's); None restores the default. Returns the previous value."""
    global validated
    setting = _setting(name)
    old = get(name)
    new = setting.default if value is None else _parse(setting, value)
    with _lock:
        _values[name] = new
        current.__dict__.pop(name, None)
        validated = False
    return old


def validate() -> bool:
    """Read every setting not read yet: a ``ValueError`` for the first bad one (``get`` raises
    the same at that setting's first use). True when it read them now, False when nothing was
    left to read since the last ``reload`` or ``set``."""
    global validated
    if validated:
        return False
    for name in SETTINGS:
        get(name)
    validated = True
    return True


def reload() -> None:
    """Forget every value read or set: the next ``get`` reads the environment again."""
    global validated
    with _lock:
        _values.clear()
        current.__dict__.clear()
        validated = False


def table() -> str:
    """The settings as the README's Markdown table."""
    rows = ["| variable | default | accepts | meaning |", "|---|---|---|---|"]
    for s in SETTINGS.values():
        rows.append(f"| `{s.name}` | {s.shown} | {s.accepts} | {s.meaning} |")
    return "\n".join(rows)
