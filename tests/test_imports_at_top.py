"""Imports at the top of a module unless a comment says why not, and no circle of imports.

An import inside a function body is allowed when a comment gives its reason: on the import's line or the line
above it (one comment serves a group of consecutive imports), or once for the whole module in a module-level
comment starting `# imports inside functions:` (modules where every function imports lazily for the same reason,
e.g. `ptq/api.py` and `ptq/commands/*`, which keep `import ptq` and the command line cheap:
`tests/test_cli_imports.py`). The reasons in use: a slow import the first use pays for (scipy, numba kernels,
onnx.reference), onnxruntime (its import starts a thread and stops the workers' fork), an optional dependency
(ray), the command line's cheap parser. Never a circle: `test_no_import_circle` follows every import, at the
top or inside a function, between the project's modules (`tests/test_layers.py` orders the packages; this
catches a circle inside one, e.g. the calibration pipeline, its adjustments and the range search, which
function-level imports used to close).
"""
from __future__ import annotations

import ast
import io
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("ptq", "ops", "lut", "calibrators", "reports", "dsp")
MODULE_REASON = "# imports inside functions:"


def unexplained_imports(source: str) -> list[str]:
    """`line: module` of every import inside a function body without a reason comment (module docstring)."""
    comments: dict[int, str] = {}
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            comments[token.start[0]] = token.string
    lines = source.splitlines()
    if any(text.startswith(MODULE_REASON) and not lines[line - 1].startswith((" ", "\t"))
           for line, text in comments.items()):
        return []
    inner: dict[int, str] = {}

    def walk(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)) and in_function:
                inner[child.lineno] = child.module if isinstance(child, ast.ImportFrom) else child.names[0].name
            walk(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    walk(ast.parse(source), False)
    bad = []
    for line, module in sorted(inner.items()):
        first, last = line, line
        while first - 1 in inner:
            first -= 1
        while last + 1 in inner:
            last += 1
        above = lines[first - 2].strip() if first > 1 else ""
        if not any(k in comments for k in range(first, last + 1)) and not above.startswith("#"):
            bad.append(f"{line}: {module}")
    return bad


def test_every_function_level_import_says_why():
    bad = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            where = path.relative_to(ROOT).as_posix()
            bad += [f"{where}:{hit}" for hit in unexplained_imports(path.read_text())]
    assert bad == []


def test_the_check_catches_an_unexplained_import():
    source = (
        "import os\n"
        "def lazy():\n"
        "    import json\n"  # no reason: flagged
        "    return json\n"
        "def explained():\n"
        "    import scipy.special  # slow to import\n"
        "    from scipy import sparse\n"  # the group's comment covers it
        "    return scipy, sparse\n"
        "def above():\n"
        "    # onnxruntime starts a thread\n"
        "    import onnxruntime\n"
        "    return onnxruntime\n"
        "class K:\n"
        "    def method(self):\n"
        "        from pathlib import Path\n"  # flagged
        "        return Path\n"
    )
    assert unexplained_imports(source) == ["3: json", "15: pathlib"]
    assert unexplained_imports("# imports inside functions: the parser stays cheap\n" + source) == []
    # the module-level reason must be at the module's level, not inside a function
    assert unexplained_imports(source.replace("    return json\n",
                                              "    # imports inside functions: not here\n    return json\n")) != []


def _module_names(root: Path) -> dict[str, Path]:
    names = {}
    for package in PACKAGES:
        for path in (root / package).rglob("*.py"):
            parts = path.relative_to(root).with_suffix("").parts
            names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return names


def import_graph(root: Path) -> dict[str, set[str]]:
    """Module -> the project modules it imports anywhere in its body, `if TYPE_CHECKING:` blocks aside (a name
    imported from a package counts as its submodule when it is one)."""
    names = _module_names(root)

    def module_of(dotted: str) -> str:
        while dotted and dotted not in names:
            dotted = dotted.rpartition(".")[0]
        return dotted

    graph: dict[str, set[str]] = {name: set() for name in names}
    for name, path in names.items():
        tree = ast.parse(path.read_text(), str(path))
        # `if TYPE_CHECKING:` imports are read by type checkers only: they close no circle at run time
        typing_only = {id(inner) for node in ast.walk(tree) if isinstance(node, ast.If)
                       and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"
                       for inner in ast.walk(node)}
        for node in ast.walk(tree):
            if id(node) in typing_only:
                continue
            if isinstance(node, ast.Import):
                targets = [module_of(alias.name) for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                targets = [module_of(f"{node.module}.{alias.name}") for alias in node.names]
            else:
                continue
            graph[name].update(t for t in targets if t and t != name)
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_circle():
    assert circles(import_graph(ROOT)) == []


def test_the_circle_check_catches_a_function_level_circle(tmp_path):
    (tmp_path / "ptq" / "calibration").mkdir(parents=True)
    (tmp_path / "ptq" / "calibration" / "pipeline.py").write_text(
        "from ptq.calibration import adjustments\n")
    (tmp_path / "ptq" / "calibration" / "adjustments.py").write_text(
        "def searched():\n    from ptq.calibration.range_search import search  # closes the circle\n")
    (tmp_path / "ptq" / "calibration" / "range_search.py").write_text(
        "def entries():\n    from ptq.calibration.pipeline import activation_entries\n")
    (tmp_path / "ptq" / "calibration" / "entries.py").write_text("import numpy\n")
    assert circles(import_graph(tmp_path)) == [
        ["ptq.calibration.adjustments", "ptq.calibration.pipeline", "ptq.calibration.range_search"]]
