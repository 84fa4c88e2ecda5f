"""The layout of the packages under src/: which may import which.

``ipc``, ``modelfiles``, ``runner`` and ``supervisor`` sit side by side. The supervisor never
imports the runner (the runner is the only package that imports mlx and mlx_lm), and both read
model files through ``modelfiles``, which imports none of them, nor mlx, mlx_lm or anyio.

The static rules read every module's imports with ``ast`` (``src_imports``): module-level ones
and those inside functions alike, so a lazy import cannot slip past. A rule is a function of
that map; add one as a test that calls ``forbidden_imports`` or walks ``src_imports()``.
"""

from __future__ import annotations

import ast
import functools
import graphlib
import json
import subprocess
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGES = ("ipc", "modelfiles", "runner", "supervisor")

# What modelfiles may never import: the runner's heavy libraries, the event loop, and the two
# packages that use it.
MODELFILES_FORBIDDEN = ("mlx", "mlx_lm", "anyio", "runner", "supervisor")


@dataclass(frozen=True)
class Import:
    """One import statement's target, as a module of ``src/`` names it."""

    target: str  # absolute: "mlx.core" (import mlx.core), "runner" (from runner import builtin)
    names: tuple[str, ...]  # what a from-import takes; () for a plain import
    line: int
    module_level: bool  # run when the module is imported (not inside a function body)
    type_checking: bool  # under ``if TYPE_CHECKING:`` (never run)

    @property
    def package(self) -> str:
        """The top-level package imported: "mlx" for mlx.core."""
        return self.target.split(".")[0]

    def imported_modules(self) -> tuple[str, ...]:
        """The modules this statement may import: the target, and for a from-import each
        ``target.name`` too (a name may be a submodule; which is which needs the files)."""
        return (self.target, *(f"{self.target}.{name}" for name in self.names if name != "*"))


def module_name(path: Path, src: Path = SRC) -> str:
    """``runner.builtin`` for ``src/runner/builtin.py``, ``runner`` for its ``__init__.py``."""
    parts = path.relative_to(src).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_in_source(module: str, source: str, is_package: bool = False) -> list[Import]:
    """Every import statement in ``source`` (the text of module ``module``), relative imports
    made absolute, in the order they appear."""
    base = module.split(".") if is_package else module.split(".")[:-1]
    found: list[Import] = []

    def visit(node: ast.AST, module_level: bool, type_checking: bool) -> None:
        if isinstance(node, ast.Import):
            for alias in node.names:
                found.append(Import(alias.name, (), node.lineno, module_level, type_checking))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parent = base[: len(base) - (node.level - 1)]
                target = ".".join([*parent, *([node.module] if node.module else [])])
            else:
                target = node.module or ""
            names = tuple(alias.name for alias in node.names)
            found.append(Import(target, names, node.lineno, module_level, type_checking))
        for child in ast.iter_child_nodes(node):
            inner = module_level and not isinstance(
                node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda
            )
            guarded = type_checking or (isinstance(node, ast.If) and _is_type_checking(node.test))
            # Only the if-branch of ``if TYPE_CHECKING:`` is never run.
            if isinstance(node, ast.If) and child in node.orelse:
                guarded = type_checking
            visit(child, inner, guarded)

    visit(ast.parse(source), True, False)
    return found


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


@functools.cache
def src_imports() -> Mapping[str, tuple[Import, ...]]:
    """Module name -> its imports, for every module of the packages under ``src/``."""
    result: dict[str, tuple[Import, ...]] = {}
    for package in PACKAGES:
        for path in sorted((SRC / package).rglob("*.py")):
            name = module_name(path)
            source = path.read_text(encoding="utf-8")
            is_package = path.name == "__init__.py"
            result[name] = tuple(imports_in_source(name, source, is_package))
    return result


def modules_under(package: str) -> list[str]:
    """The modules of ``package`` (itself included), as ``src_imports`` names them."""
    return [m for m in src_imports() if m == package or m.startswith(package + ".")]


def forbidden_imports(package: str, forbidden: Iterable[str]) -> list[str]:
    """``module:line imports target`` for each import under ``package`` of a package in
    ``forbidden`` (or one of its submodules), wherever the statement is."""
    banned = set(forbidden)
    return [
        f"{module}:{imp.line} imports {imp.target}"
        for module in modules_under(package)
        for imp in src_imports()[module]
        if imp.package in banned
    ]


# --------------------------------------------------------------------------------------------
# The scan itself
# --------------------------------------------------------------------------------------------


def test_the_scan_finds_every_kind_of_import() -> None:
    source = (
        "from __future__ import annotations\n"
        "import os.path\n"
        "from typing import TYPE_CHECKING\n"
        "from . import sibling\n"
        "from ..other import thing as alias\n"
        "if TYPE_CHECKING:\n"
        "    import mlx.core as mx\n"
        "else:\n"
        "    import json\n"
        "try:\n"
        "    import fcntl\n"
        "except ImportError:\n"
        "    pass\n"
        "def f():\n"
        "    from runner.builtin import ensure_builtin_model\n"
        "    def g():\n"
        "        import anyio\n"
        "class C:\n"
        "    import struct\n"
        "    def m(self):\n"
        "        import mlx_lm\n"
    )
    found = {
        imp.target: (imp.names, imp.module_level, imp.type_checking)
        for imp in imports_in_source("pkg.sub.mod", source)
    }
    assert found == {
        "__future__": (("annotations",), True, False),
        "os.path": ((), True, False),
        "typing": (("TYPE_CHECKING",), True, False),
        "pkg.sub": (("sibling",), True, False),
        "pkg.other": (("thing",), True, False),
        "mlx.core": ((), True, True),
        "json": ((), True, False),
        "fcntl": ((), True, False),
        "runner.builtin": (("ensure_builtin_model",), False, False),
        "anyio": ((), False, False),
        "struct": ((), True, False),
        "mlx_lm": ((), False, False),
    }
    (package_import,) = imports_in_source("pkg", "from . import mod\n", is_package=True)
    assert package_import.target == "pkg"
    assert package_import.imported_modules() == ("pkg", "pkg.mod")


def test_the_scan_covers_src() -> None:
    modules = src_imports()
    for package in PACKAGES:
        assert package in modules, f"src/{package}/__init__.py was not scanned"
    assert "modelfiles.gguf" in modules

    # Known edges, so that an empty scan cannot pass the rules below.
    def packages_imported(package: str) -> set[str]:
        return {imp.package for m in modules_under(package) for imp in modules[m]}

    assert "mlx" in packages_imported("runner")
    assert "modelfiles" in packages_imported("supervisor")


# --------------------------------------------------------------------------------------------
# Rules
# --------------------------------------------------------------------------------------------


def test_the_supervisor_never_imports_the_runner() -> None:
    """Not even lazily: what both sides need of model files is in modelfiles."""
    assert forbidden_imports("supervisor", ["runner"]) == []


def test_modelfiles_imports_neither_mlx_nor_anyio_nor_runner_nor_supervisor() -> None:
    assert forbidden_imports("modelfiles", MODELFILES_FORBIDDEN) == []


def test_importing_modelfiles_loads_no_forbidden_module() -> None:
    """In a fresh interpreter, importing every module of modelfiles loads none of the forbidden
    packages, nor numpy or gguf-py (which the converter alone imports, when it runs)."""
    never = (*MODELFILES_FORBIDDEN, "numpy", "gguf")
    script = (
        "import importlib, json, pkgutil, sys\n"
        "import modelfiles\n"
        "found = pkgutil.walk_packages(modelfiles.__path__, 'modelfiles.')\n"
        "names = sorted(m.name for m in found)\n"
        "for name in names:\n"
        "    importlib.import_module(name)\n"
        "never = set(sys.argv[1:])\n"
        "loaded = sorted(m for m in sys.modules if m.split('.')[0] in never)\n"
        "sys.stdout.write(json.dumps({'modules': names, 'loaded': loaded}))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", script, *never],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    expected = {module_name(p) for p in (SRC / "modelfiles").rglob("*.py")} - {"modelfiles"}
    assert set(out["modules"]) == expected
    assert out["loaded"] == []


def import_graph(include_type_checking: bool = True) -> dict[str, set[str]]:
    """Module -> the modules of ``src/`` it imports (anywhere in its text; with
    ``include_type_checking``, the imports only type checkers run count too)."""
    modules = src_imports()
    graph: dict[str, set[str]] = {}
    for module, found in modules.items():
        edges = set()
        for imp in found:
            if imp.type_checking and not include_type_checking:
                continue
            known = [m for m in imp.imported_modules() if m in modules and m != module]
            edges |= {m for m in known if not module.startswith(m + ".")}
        graph[module] = edges
    return graph


def test_no_import_circle() -> None:
    """No module imports, even lazily or for type checking only, one that imports it back
    (through any chain): each package reads bottom-up."""
    try:
        order = list(graphlib.TopologicalSorter(import_graph()).static_order())
    except graphlib.CycleError as exc:
        raise AssertionError(f"import circle: {' -> '.join(exc.args[1])}") from None
    assert len(order) == len(src_imports())


def test_the_circle_check_sees_a_circle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}}
    with pytest.raises(graphlib.CycleError):
        list(graphlib.TopologicalSorter(graph).static_order())


def test_ipc_depends_on_msgspec_only() -> None:
    """Both sides import ipc; it imports neither of them, and only ipc.aio (which the runner
    never imports) uses the event loop."""
    assert forbidden_imports("ipc", ["runner", "supervisor", "modelfiles", "mlx", "mlx_lm"]) == []
    users = {m for m in modules_under("ipc") for imp in src_imports()[m] if imp.package == "anyio"}
    assert users == {"ipc.aio"}


def test_the_runner_imports_no_anyio_and_no_supervisor() -> None:
    assert forbidden_imports("runner", ["anyio", "supervisor"]) == []
    assert not any(
        imp.target == "ipc.aio" or "aio" in imp.names
        for m in modules_under("runner")
        for imp in src_imports()[m]
        if imp.package == "ipc"
    )


def test_every_module_imports_in_dependency_order_in_a_fresh_interpreter() -> None:
    """Imported one by one, each after what it imports: none fails, and a runner's start
    (``runner.main``) loads no anyio."""
    order = [
        m
        for m in graphlib.TopologicalSorter(import_graph(False)).static_order()
        if not m.endswith("__main__")
    ]
    script = (
        "import importlib, sys\n"
        "import runner.main\n"
        "assert not [m for m in sys.modules if m.split('.')[0] == 'anyio'], 'runner loads anyio'\n"
        "for name in sys.argv[1:]:\n"
        "    importlib.import_module(name)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", script, *order],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
