"""The package's layers, stated once: every import points down (or stays in its layer), no
module imports another's private names, there is no import cycle, and ``portable/`` needs
nothing but itself and the standard library.

Imports are read from the source, module-level and deferred alike (an import inside a
function or under ``if TYPE_CHECKING:`` counts the same as one at the top).
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "overbrainer"

# top to bottom; a module may import its own layer and the layers below it
LAYERS = [
    ("api", ["overbrainer", "overbrainer.__main__", "overbrainer.cli", "overbrainer.serve"]),
    ("runtime", ["overbrainer.runtime"]),
    ("graph", ["overbrainer.graph"]),
    ("steps", ["overbrainer.steps"]),
    ("parts", ["overbrainer.inputs", "overbrainer.where", "overbrainer.trainers", "overbrainer.formats", "overbrainer.trackers",
               "overbrainer.chat"]),
    ("ground", ["overbrainer.plan", "overbrainer.remembered", "overbrainer.stamps", "overbrainer.hashing",
                "overbrainer.folder", "overbrainer.fsio", "overbrainer.journal", "overbrainer.errors", "overbrainer.version"]),
    ("portable", ["overbrainer.portable"]),
]


def module_names() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


MODULES = module_names()


def layer_of(module: str) -> int:
    best, at = -1, None
    for i, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            exact = prefix == "overbrainer"
            if module == prefix or (not exact and module.startswith(prefix + ".")):
                if len(prefix) > best:
                    best, at = len(prefix), i
    assert at is not None, f"{module} is in no layer: add it to LAYERS"
    return at


def imports(module: str) -> list[tuple[str, int, list[str]]]:
    """(imported internal module, line, names taken from it) for every import of `module`."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno, []) for a in node.names if a.name.split(".")[0] == "overbrainer"]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            elif (node.module or "").split(".")[0] == "overbrainer":
                target = node.module
            else:
                continue
            names = []
            for alias in node.names:
                if f"{target}.{alias.name}" in MODULES:
                    out.append((f"{target}.{alias.name}", node.lineno, []))  # a submodule
                else:
                    names.append(alias.name)
            if names:
                out.append((target, node.lineno, names))
    return out


def test_every_module_is_in_a_layer():
    for module in MODULES:
        layer_of(module)


def test_imports_point_down():
    upward = []
    for module in MODULES:
        for target, line, _ in imports(module):
            if layer_of(target) < layer_of(module):
                upward.append(f"{MODULES[module].relative_to(PACKAGE.parent)}:{line}: {module} "
                              f"({LAYERS[layer_of(module)][0]}) imports {target} ({LAYERS[layer_of(target)][0]})")
    assert upward == []


def test_no_private_names_of_another_module():
    taken = []
    for module in MODULES:
        for target, line, names in imports(module):
            private = [n for n in names if n.startswith("_") and not n.startswith("__")]
            if private and target != module:
                taken.append(f"{MODULES[module].relative_to(PACKAGE.parent)}:{line}: {private} from {target}")
    assert taken == []


def test_no_import_cycles():
    graph = {m: sorted({t for t, _, _ in imports(m) if t in MODULES and t != m}) for m in MODULES}
    index, low, stack, on_stack, cycles = {}, {}, [], set(), []

    def visit(v):  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    assert cycles == []


def test_portable_needs_only_itself_and_the_standard_library():
    """What is shipped into job folders runs where overbrainer is not installed: at module
    level its files import the standard library and each other, nothing else (a package
    of the trainer's is imported inside a function, or tried)."""
    for path in (PACKAGE / "portable").glob("*.py"):
        tree = ast.parse(path.read_text())
        for node in tree.body:  # module level, outside try/if/def
            if isinstance(node, ast.Import):
                names = [a.name.split(".")[0] for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level == 1:
                    continue
                assert node.level == 0, f"{path.name}:{node.lineno}: reaches outside portable/"
                names = [node.module.split(".")[0]]
            else:
                continue
            foreign = [n for n in names if n not in sys.stdlib_module_names and n != "__future__"]
            assert not foreign, f"{path.name}:{node.lineno}: imports {foreign} at module level"
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level > 1:
                raise AssertionError(f"{path.name}:{node.lineno}: reaches outside portable/")
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                module = node.module if isinstance(node, ast.ImportFrom) else node.names[0].name
                assert not (module or "").startswith("overbrainer"), f"{path.name}:{node.lineno}: imports overbrainer"


def test_the_test_sees_a_violation(tmp_path, monkeypatch):
    """The checks can fail: an upward import and a cycle written into a copy are found."""
    import shutil

    copy = tmp_path / "overbrainer"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    (copy / "folder.py").write_text((copy / "folder.py").read_text() + "\nfrom .graph import driver  # noqa\n")
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", copy)
    monkeypatch.setattr(sys.modules[__name__], "MODULES", module_names())
    try:
        test_imports_point_down()
    except AssertionError as e:
        assert "overbrainer.folder (ground) imports overbrainer.graph.driver (graph)" in str(e)
    else:
        raise AssertionError("an upward import was not found")
    try:
        test_no_import_cycles()
    except AssertionError as e:
        assert "overbrainer.folder" in str(e)
    else:
        raise AssertionError("a cycle was not found")
