"""The package's layout, checked on its source with ``ast``: no import cycles among the
``collectives`` modules (imports inside functions included), no module reaching into another's
private names, algorithm modules below the public API (no import of it, not even inside a
function), the node's shared-memory family in ``collectives/node/``, ``api.py`` kept small;
and the README's algorithm table lists every name the registry takes."""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "collectives"
# Folders whose modules are checked, and the package each is: ring/ and tree/ are installed as
# collectives.ring and collectives.tree (setup.cfg's package_dir).
TREES = {ROOT / "collectives": "collectives", ROOT / "ring": "collectives.ring",
         ROOT / "tree": "collectives.tree"}
PRIVATE_TREES = {**TREES, ROOT / "bench": "bench"}


def _modules(trees: dict) -> dict[str, tuple[Path, bool]]:
    """{dotted name: (file, is a package's __init__)} of every module under ``trees``."""
    found = {}
    for folder, package in trees.items():
        if not folder.is_dir():
            continue
        for path in sorted(folder.rglob("*.py")):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            is_init = parts[-1] == "__init__"
            if is_init:
                parts = parts[:-1]
            found[".".join([package] + parts)] = (path, is_init)
    return found


MODULES = _modules(TREES)


def _resolve(module: str, is_init: bool, node: ast.ImportFrom) -> str:
    """The absolute module an ``ImportFrom`` in ``module`` names (relative ones resolved)."""
    if not node.level:
        return node.module or ""
    base = module.split(".")
    if not is_init:
        base = base[:-1]  # a module's own package
    base = base[:len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _imports(module: str, path: Path, is_init: bool, deep: bool = False) -> set[str]:
    """The ``collectives`` modules that ``module`` imports at module level (top-level
    ``import``/``from`` statements only; ``deep``: inside functions too): ``from pkg import x``
    is pkg.x where that is a module, else pkg (a name the package's __init__ re-exports)."""
    out = set()
    tree = ast.parse(path.read_text(), str(path))
    for node in ast.walk(tree) if deep else tree.body:
        if isinstance(node, ast.Import):
            for alias in node.names:
                name = alias.name
                while name and name not in MODULES:  # import a.b.c: the deepest known module
                    name = name.rpartition(".")[0]
                if name:
                    out.add(name)
        elif isinstance(node, ast.ImportFrom):
            source = _resolve(module, is_init, node)
            for alias in node.names:
                target = f"{source}.{alias.name}"
                if target in MODULES:
                    out.add(target)
                elif source in MODULES:
                    out.add(source)
    out.discard(module)
    return out


def _graph(deep: bool = False) -> dict[str, set[str]]:
    """{module: the modules it imports} (``deep``: at any depth, inside functions too)."""
    return {m: _imports(m, path, init, deep) for m, (path, init) in MODULES.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as a path that starts and ends at the same module, or None."""
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    stack: list[str] = []

    def visit(node):
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_the_module_list_is_complete():
    assert {"collectives", "collectives.api", "collectives.select", "collectives.config",
            "collectives.executor", "collectives.ring", "collectives.tree"} <= set(MODULES)


# The node's shared-memory family, one package: the window and its handshake, the registered
# buffers, CMA reads, and the algorithms on them.
NODE = ("window", "registered", "cma", "shm", "onepass", "composite")


def test_the_node_family_is_one_package():
    assert {f"collectives.node.{name}" for name in NODE} <= set(MODULES)
    stray = {f"collectives.{name}" for name in NODE} & set(MODULES)
    assert not stray, f"node modules outside collectives/node/: {sorted(stray)}"


def test_the_cycle_finder_finds_cycles():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": {"b2"}, "b2": {"b"}}) == ["b", "b2", "b"]


def test_relative_imports_resolve():
    def resolve(module, is_init, code):
        return _resolve(module, is_init, ast.parse(code).body[0])
    assert resolve("collectives.api", False, "from . import config") == "collectives"
    assert resolve("collectives.api", False, "from .select import get") == \
        "collectives.select"
    assert resolve("collectives.torch", True, "from ..ops import x") == "collectives.ops"
    assert resolve("collectives.torch.ddp", False, "from .. import api") == "collectives"


def test_no_import_cycles():
    """No cycle among the modules' imports, those inside functions included: an import deferred
    to a call hides a cycle from Python's loader but not from the reader, and a module that
    needs one that imports it means a record or a function lives a layer too high."""
    for deep in (False, True):
        cycle = _cycle(_graph(deep))
        where = " (imports inside functions included)" if deep else ""
        assert cycle is None, f"import cycle{where}: " + " -> ".join(cycle)


def test_function_level_imports_are_edges():
    tmp = ROOT / "tests" / "__layout_probe__.py"  # never written: parsed from a string
    code = ("from . import config\n"
            "def f():\n    from .node import onepass\n"
            "class C:\n    def g(self):\n        import collectives.dispatch\n")

    class FakePath(type(tmp)):
        def read_text(self, *args, **kwargs):
            return code

    assert _imports("collectives.select", FakePath(tmp), False) == {"collectives.config"}
    assert _imports("collectives.select", FakePath(tmp), False, deep=True) == \
        {"collectives.config", "collectives.node.onepass", "collectives.dispatch"}


def _private_uses(module: str, path: Path, is_init: bool, known: dict) -> list[str]:
    """Where ``module`` imports another module's private name, or reads one as an attribute
    of a module of ``known`` it imported (``module._name``; dunders allowed; other packages',
    such as ``torch._C``, are theirs to judge)."""
    def private(name):
        return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))

    tree = ast.parse(path.read_text(), str(path))
    found, bound = [], {}  # bound: local name -> the module it names
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname:
                    bound[alias.asname] = alias.name
                else:
                    bound[alias.name.partition(".")[0]] = alias.name.partition(".")[0]
        elif isinstance(node, ast.ImportFrom):
            source = _resolve(module, is_init, node)
            for alias in node.names:
                target = f"{source}.{alias.name}"
                if target in known:
                    bound[alias.asname or alias.name] = target
                elif private(alias.name) and source != module and \
                        (source in known or source.split(".")[0] in ("collectives", "bench")):
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}: from {source} "
                                 f"import {alias.name}")
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and \
                private(node.attr) and bound.get(node.value.id) in known and \
                bound[node.value.id] != module:
            found.append(f"{path.relative_to(ROOT)}:{node.lineno}: "
                         f"{node.value.id}.{node.attr} ({bound[node.value.id]})")
    return found


def test_no_module_uses_another_modules_private_names():
    known = _modules(PRIVATE_TREES)
    found = []
    for module, (path, is_init) in known.items():
        found += _private_uses(module, path, is_init, known)
    assert not found, f"{len(found)} private names used across modules:\n" + "\n".join(found)


def test_private_name_finder():
    tmp = ROOT / "tests" / "__layout_probe__.py"  # never written: parsed from a string
    code = ("from collectives import api\nfrom collectives.api import _auto, Call\n"
            "import collectives.select as sel\nfrom . import ops\nimport torch\n"
            "api._context(None); sel.__name__; sel.get; ops._ACCEPTS; self._x; torch._C\n")

    class FakePath(type(tmp)):
        def read_text(self, *args, **kwargs):
            return code

    found = _private_uses("collectives.fake", FakePath(tmp), False, MODULES)
    assert len(found) == 3, found
    assert any("import _auto" in f for f in found)
    assert any("api._context" in f for f in found)
    assert any("ops._ACCEPTS" in f for f in found)


# Algorithm modules: schedules and the node's algorithms. They sit below the public API: a
# composite that needs another collective builds its schedule and runs it with the executor;
# one that called ``collectives.allreduce`` from inside a running call would re-enter dispatch
# (validation, choice, a watchdog entry, a drain of the communicator's pending calls).
ALGORITHMS = ("collectives.ring", "collectives.tree", "collectives.node",
              "collectives.hierarchical", "collectives.hierarchical_alltoall",
              "collectives.native")
PUBLIC = {"collectives", "collectives.api"}  # the package's re-exports and what they come from


def _public_imports(modules: dict) -> list[str]:
    """Where an algorithm module of ``modules`` imports the public API, at any depth."""
    found = []
    for module, (path, is_init) in modules.items():
        if not any(module == a or module.startswith(a + ".") for a in ALGORITHMS):
            continue
        for target in sorted(_imports(module, path, is_init, deep=True) & PUBLIC):
            found.append(f"{path.relative_to(ROOT)}: imports {target}")
    return found


def test_algorithm_modules_never_import_the_public_api():
    assert {m for m in MODULES if m.startswith("collectives.node.")}, "no node modules found"
    found = _public_imports(MODULES)
    assert not found, "algorithm modules importing the public API:\n" + "\n".join(found)


def test_public_import_finder():
    tmp = ROOT / "tests" / "__layout_probe__.py"  # never written: parsed from a string
    codes = {"def f():\n    import collectives as coll\n": 1,
             "def f():\n    from collectives import allreduce\n": 1,
             "def f():\n    from .. import api\n": 1,
             "from collectives import config\nfrom ..executor import context\n"
             "def f():\n    from collectives.ring import allreduce\n": 0}
    for code, expected in codes.items():
        class FakePath(type(tmp)):
            def read_text(self, *args, _code=code, **kwargs):
                return _code

        probe = {"collectives.node.probe": (FakePath(tmp), False)}
        assert len(_public_imports(probe)) == expected, code


def _readme_algorithms(collectives: tuple) -> dict[str, set[str]]:
    """{collective: the names README.md's algorithm table gives for it}: a row's names are the
    backquoted ones of its first cell, its collectives those named in its second cell before
    any remark (``(``, ``:``), ``all`` for every one."""
    text = (ROOT / "README.md").read_text()
    start = text.index("| name | collectives | cost |")
    found: dict[str, set[str]] = {c: set() for c in collectives}
    for line in text[start:].splitlines()[2:]:
        if not line.startswith("|"):
            break
        first, second = line.split("|")[1:3]
        names = set(re.findall(r"`([a-z_]+)`", first))
        head = re.split(r"[(:]", second)[0]
        words = set(re.findall(r"[a-z_]+", head))
        for c in collectives if "all" in words else words & set(collectives):
            found[c] |= names
    return found


def test_readme_lists_every_algorithm_for_every_collective():
    from collectives import registry
    import collectives as coll
    listed = _readme_algorithms(registry.COLLECTIVES)
    wrong = {c: (sorted(set(coll.algorithms(c)) - listed[c]),
                 sorted(listed[c] - set(coll.algorithms(c))))
             for c in registry.COLLECTIVES if listed[c] != set(coll.algorithms(c))}
    assert not wrong, "README's algorithm table, {collective: (missing, not registered)}: " + \
        str(wrong)


def test_api_is_under_600_lines():
    lines = len((ROOT / "collectives" / "api.py").read_text().splitlines())
    assert lines < 600, f"collectives/api.py has {lines} lines"


if __name__ == "__main__":  # print what the checks find
    print(_cycle(_graph()), _cycle(_graph(deep=True)))
    known = _modules(PRIVATE_TREES)
    for m, (p, i) in known.items():
        for f in _private_uses(m, p, i, known):
            print(f)
    pytest.main([__file__, "-q"])
