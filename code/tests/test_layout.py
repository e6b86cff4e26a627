"""The house rules of the package layout, checked on the source: no import cycle, no module importing another
module's private names, no library module importing the apps (`cli`, `server`), tests outside the package,
and one definition of the model flags that every command parses the same way."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "tt_moge"
APPS = ("tt_moge.cli", "tt_moge.server", "tt_moge.bench_breakdown", "tt_moge.__main__")


def _modules(package: Path = PACKAGE) -> dict:
    """{dotted module name: path} of every module of the package."""
    found = {}
    for path in package.rglob("*.py"):
        parts = list(path.relative_to(package.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def _imports(modules: dict) -> list:
    """[(importer, imported module, imported name or None)] for every import of a tt_moge module."""
    edges = []
    for name, path in modules.items():
        is_package = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                edges += [(name, alias.name, None) for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = name.split(".") if is_package else name.split(".")[:-1]
                    anchor = anchor[: len(anchor) - node.level + 1]
                    base = ".".join(anchor + ([node.module] if node.module else []))
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    edges.append((name, sub, None) if sub in modules else (name, base, alias.name))
    resolved = []
    for importer, target, symbol in edges:
        while target not in modules and "." in target:
            target = target.rsplit(".", 1)[0]
        if target in modules and target.startswith("tt_moge") and target != importer:
            resolved.append((importer, target, symbol))
    return resolved


def _cycles(graph: dict) -> list:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
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
                found.append(sorted(component))

    for v in list(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycle_no_private_import_no_library_importing_an_app():
    modules = _modules()
    edges = _imports(modules)
    assert len(edges) > 50, "the import walk found too little: it is broken"
    packages = {m for m, p in modules.items() if p.name == "__init__.py"}
    graph = defaultdict(set)
    for importer, target, _ in edges:
        if importer not in packages and target not in packages:  # a package's re-exports are not a cycle
            graph[importer].add(target)
    assert _cycles(graph) == []
    private = [
        f"{importer} imports {target}.{symbol}"
        for importer, target, symbol in edges
        if symbol and symbol.startswith("_") and not symbol.startswith("__")
    ]
    assert private == []
    library_to_app = [
        f"{importer} -> {target}"
        for importer, target, _ in edges
        if not importer.startswith(APPS) and target.startswith(APPS)
    ]
    assert library_to_app == []


def _testing_and_warmup_imports(edges: list) -> list:
    """Imports of the test support (`tt_moge.testing`) by the library, and of the warm-up by a runner."""
    return [
        f"{importer} -> {target}"
        for importer, target, _ in edges
        if (target.startswith("tt_moge.testing") and not importer.startswith("tt_moge.testing"))
        or (importer.startswith("tt_moge.runners") and target == "tt_moge.warmup")
    ]


def test_the_library_imports_no_test_support_and_no_runner_the_warm_up():
    """Test support is not a dependency of what users run (issue 47): the demo scene (`tt_moge.scene`), random-weight
    checkpoints (`tt_moge.random_weights`) and the synthetic photo (`tt_moge.synthetic`) are library modules that
    `tt_moge.testing` re-exports; a runner does not reach into the warm-up for a photo."""
    assert _testing_and_warmup_imports(_imports(_modules())) == []
    fake = {"tt_moge.server.ui": ("tt_moge.testing.scene", None), "tt_moge.runners.graph": ("tt_moge.warmup", None)}
    assert len(_testing_and_warmup_imports([(k, *v) for k, v in fake.items()])) == 2  # it sees both kinds


def test_the_checker_sees_what_it_guards(tmp_path):
    """The rules above fail on a package that breaks them (a cycle, a private import, a library importing cli)."""
    fake = tmp_path / "tt_moge"
    (fake / "cli").mkdir(parents=True)
    (fake / "__init__.py").write_text("")
    (fake / "cli" / "__init__.py").write_text("")
    (fake / "cli" / "entry.py").write_text("from ..a import _hidden\n")
    (fake / "a.py").write_text("from . import b\nfrom .cli import entry\n_hidden = 1\n")
    (fake / "b.py").write_text("from .a import _hidden\n")
    modules = _modules(fake)
    edges = _imports(modules)
    graph = defaultdict(set)
    for importer, target, _ in edges:
        graph[importer].add(target)
    assert _cycles(graph) == [["tt_moge.a", "tt_moge.b", "tt_moge.cli.entry"]]
    assert ("tt_moge.b", "tt_moge.a", "_hidden") in edges and ("tt_moge.a", "tt_moge.cli.entry", None) in edges


def test_tests_are_not_shipped():
    from setuptools import find_packages

    assert not (PACKAGE / "tests").exists()
    shipped = find_packages(str(PACKAGE.parent), include=["tt_moge*"])
    assert "tt_moge" in shipped and "tt_moge.cli" in shipped
    assert not [p for p in shipped if "test" in p.split(".")[-1] and p != "tt_moge.testing"]


FLAGS = [
    "--weights",
    "w.pt",
    "--revision",
    "main",
    "--device",
    "cpu",
    "--device-id",
    "1",
    "--resolution",
    "640x480",
    "--num-tokens",
    "1200",
    "--precision",
    "fp32",
    "--dispatch",
    "worker",
    "--num-command-queues",
    "2",
    "--warmup",
    "1",
    "--warmup-variants",
    "minimal,none",
    "--verbose",
]


@pytest.mark.parametrize("revision", ["main", "", "abc123"])
def test_every_command_parses_the_model_flags_the_same_way(revision):
    from tt_moge.cli import build_parser
    from tt_moge.cli.common import model_kwargs
    from tt_moge.options import normalize_revision

    parser = build_parser()
    flags = [f if f != "main" else revision for f in FLAGS]
    parsed = {}
    for command in ("predict", "batch", "info", "serve", "bench"):
        positional = ["photo.png"] if command in ("predict", "batch") else []
        parsed[command] = model_kwargs(parser.parse_args([command, *positional, *flags]))
    first = parsed["predict"]
    assert first["resolution"] == (640, 480) and first["warmup_variants"] == ["minimal", "none"]
    assert all(kwargs == first for kwargs in parsed.values()), parsed
    assert normalize_revision(first["revision"]) == (None if revision in ("main", "") else revision)


def test_revision_main_is_the_default_branch_everywhere(checkpoint):
    from tt_moge.options import LoadOptions

    for revision in ("main", "", None):
        options = LoadOptions.resolve(
            checkpoint("tiny-vits-normal"), revision=revision, device="cpu", warmup_variants="none"
        )
        assert options.revision is None
    assert LoadOptions.resolve("x", revision="v2", device="cpu", warmup_variants="none").revision == "v2"


def _environment_reads(path: Path) -> list:
    """[(line, variable name)] of the os.environ / os.getenv reads of a module whose name is a string literal or
    a module-level string constant."""
    tree = ast.parse(path.read_text())
    constants = {
        t.id: node.value.value
        for node in tree.body
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)
        for t in node.targets
        if isinstance(t, ast.Name)
    }

    def name_of(arg: ast.AST):
        if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
            return arg.value
        return constants.get(arg.id) if isinstance(arg, ast.Name) else None

    def is_environ(node: ast.AST) -> bool:
        return isinstance(node, ast.Attribute) and node.attr == "environ"

    found = []
    for node in ast.walk(tree):
        arg = None
        if isinstance(node, ast.Call) and node.args and isinstance(node.func, ast.Attribute):
            if (node.func.attr == "get" and is_environ(node.func.value)) or node.func.attr == "getenv":
                arg = node.args[0]
        elif isinstance(node, ast.Subscript) and is_environ(node.value):
            arg = node.slice
        elif isinstance(node, ast.Compare) and any(is_environ(c) for c in node.comparators):
            arg = node.left
        name = name_of(arg) if arg is not None else None
        if name is not None:
            found.append((node.lineno, name))
    return found


def test_our_environment_variables_are_read_in_one_place():
    """tt_moge reads its MOGE_* variables through tt_moge/env.py only, which keeps the old TT_MOGE_* names
    working with a deprecation warning; no other module spells a TT_MOGE_* name."""
    modules = _modules()
    reads = {name: _environment_reads(path) for name, path in modules.items() if name != "tt_moge.env"}
    assert len([r for found in reads.values() for r in found]) >= 3, "the walk found no reads of other variables"
    ours = [
        f"{name}:{line} reads ${var}"
        for name, found in reads.items()
        for line, var in found
        if var.startswith(("MOGE_", "TT_MOGE_"))
    ]
    assert ours == [], "read them with tt_moge.env.get"
    old_names = [name for name, path in modules.items() if name != "tt_moge.env" and "TT_MOGE_" in path.read_text()]
    assert old_names == []


def test_the_environment_check_sees_what_it_guards(tmp_path):
    module = tmp_path / "m.py"
    module.write_text(
        'import os\nWEIGHTS = "MOGE_WEIGHTS_DIR"\na = os.environ.get(WEIGHTS)\nb = os.getenv("MOGE_HOST")\n'
        'c = os.environ["TT_MOGE_X"]\nd = "MOGE_CXX" in os.environ\ne = os.environ.get("HOME")\n'
    )
    assert _environment_reads(module) == [
        (3, "MOGE_WEIGHTS_DIR"),
        (4, "MOGE_HOST"),
        (5, "TT_MOGE_X"),
        (6, "MOGE_CXX"),
        (7, "HOME"),
    ]


def test_every_module_imports():
    """Each module of the package imports, so a name that one module dropped and another still imports fails here
    and not in the first command that loads it (the entry points, __main__, are left out: they run)."""
    import importlib
    import pkgutil

    import tt_moge

    names = [m.name for m in pkgutil.walk_packages(tt_moge.__path__, "tt_moge.") if not m.name.endswith("__main__")]
    assert len(names) > 50
    failed = {}
    for name in names:
        try:
            importlib.import_module(name)
        except Exception as exc:  # reported, not raised: every failure at once
            failed[name] = f"{type(exc).__name__}: {exc}"
    assert failed == {}
