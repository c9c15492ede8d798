"""Imports at the top of a module unless a comment says why not.

An import inside a function body is allowed when a comment gives its reason: on the import's line or the line
above it (one comment serves a group of consecutive imports), or once for the whole module in a module-level
comment starting `# imports inside functions:` (modules where every function imports lazily for the same reason,
e.g. `ptq/api.py` and `ptq/commands/*`, which keep `import ptq` and the command line cheap:
`tests/test_cli_imports.py`). The reasons in use: a slow import the first use pays for (scipy, numba kernels,
onnx.reference), onnxruntime (its import starts a thread and stops the workers' fork), an optional dependency
(ray), the command line's cheap parser.
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
