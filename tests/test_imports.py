"""Every import inside a function of the package and of ``bench/`` resolves: its module imports
and the names it takes are there. Such an import runs only when its function does (a benchmark's
``--validate``, a CUDA path), so a rename that leaves one behind fails only there, late;
this reads them with ``ast`` and imports each one here.

Optional extras that the package imports only where they are installed are skipped when absent,
by name (``OPTIONAL``), and the test says which were.
"""
from __future__ import annotations

import ast
import importlib
import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# The folders scanned, and the package each installs as (setup.cfg's package_dir).
TREES = {"collectives": "collectives", "ring": "collectives.ring", "tree": "collectives.tree",
         "bench": "bench"}
# Top-level modules that are extras: imported only where present (GPU arrays, plots).
OPTIONAL = {"cupy", "cupyx", "matplotlib"}


def _module_name(path: Path) -> tuple[str, bool]:
    """The dotted name of the module at ``path`` and whether it is a package's __init__."""
    folder = path.relative_to(ROOT).parts[0]
    parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
    is_init = parts[-1] == "__init__"
    if is_init:
        parts = parts[:-1]
    return ".".join([TREES[folder]] + parts), is_init


def _absolute(module: str, is_init: bool, node: ast.ImportFrom) -> str:
    """The module a ``from ... import`` names, relative ones resolved against ``module``."""
    if not node.level:
        return node.module or ""
    base = module.split(".")
    if not is_init:
        base = base[:-1]
    base = base[:len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def function_imports() -> list[tuple[str, int, str, str | None]]:
    """``(file, line, module, name or None)`` for every import inside a function (at any
    depth, methods included) under ``TREES``."""
    found = set()
    for folder in TREES:
        for path in sorted((ROOT / folder).rglob("*.py")):
            module, is_init = _module_name(path)
            where = str(path.relative_to(ROOT))
            for fn in ast.walk(ast.parse(path.read_text(), where)):
                if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    continue
                for node in ast.walk(fn):
                    if isinstance(node, ast.Import):
                        found.update((where, node.lineno, a.name, None) for a in node.names)
                    elif isinstance(node, ast.ImportFrom):
                        source = _absolute(module, is_init, node)
                        found.update((where, node.lineno, source, a.name) for a in node.names)
    return sorted(found)


IMPORTS = function_imports()


def test_the_scan_finds_function_level_imports():
    # bench.model.validate's own imports, the case that once named a moved function
    assert ("bench/model.py", "bench.units", "byte_sizes") in \
        {(f, m, n) for f, _, m, n in IMPORTS}
    assert any(f.startswith("collectives/") for f, *_ in IMPORTS)
    relative = ast.parse("from .. import config", "x").body[0]
    assert _absolute("collectives.node.shm", False, relative) == "collectives"
    assert _absolute("collectives.node", True, relative) == "collectives"


# Scripts of examples/ that a benchmark imports after putting examples/ on sys.path itself
# (bench/tp.py and examples/train_gpt.py): resolved as files.
EXAMPLES = {p.stem for p in (ROOT / "examples").glob("*.py")}


def _check(module: str, name: str | None) -> str | None:
    """What is wrong with ``import module`` / ``from module import name``, or None."""
    if module in EXAMPLES:
        text = (ROOT / "examples" / f"{module}.py").read_text()
        found = name is None or re.search(rf"^(?:def |class )?{name}\b", text, re.M)
        return None if found else f"examples/{module}.py defines no {name}"
    try:
        mod = importlib.import_module(module)
    except ImportError as exc:
        return f"import {module}: {exc}"
    if name is None or name == "*" or hasattr(mod, name):
        return None
    try:  # a submodule not yet imported by its package
        importlib.import_module(f"{module}.{name}")
    except ImportError as exc:
        return f"from {module} import {name}: {exc}"
    return None


def _problems(imports) -> list[str]:
    return [f"{where}:{line}: {problem}" for where, line, module, name in imports
            for problem in [_check(module, name)] if problem]


def test_a_moved_name_is_reported():
    assert _check("bench.units", "byte_sizes") is None
    assert "byte_sizes" in _check("bench.harness", "byte_sizes")
    assert "no_such_module" in _check("collectives.no_such_module", None)


def test_every_function_level_import_resolves():
    required = [i for i in IMPORTS if i[2].split(".")[0] not in OPTIONAL]
    if importlib.util.find_spec("torch") is None:  # the torch extra: checked where installed
        required = [i for i in required if i[2].split(".")[0] != "torch"
                    and not i[2].startswith("collectives.torch")]
    problems = _problems(required)
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("extra", sorted(OPTIONAL))
def test_optional_imports_resolve_where_installed(extra):
    if importlib.util.find_spec(extra) is None:
        pytest.skip(f"{extra} is not installed: its function-level imports are not checked")
    problems = _problems([i for i in IMPORTS if i[2].split(".")[0] == extra])
    assert not problems, "\n".join(problems)
