"""The layout: imports flow one way, model <- tokenizer, quantize, tp, decode <- speculate <- draftmodel, crossdraft
<- generate <- scripts, tests; nothing but scripts and tests imports generate.py."""
import ast
import subprocess
import sys

from helpers import ROOT

LIBRARY = ["model", "tokenizer", "quantize", "tp", "decode", "speculate", "draftmodel", "crossdraft"]
# each imports only earlier ones
ORDER = ["model", "tokenizer", "quantize", "tp", "decode", "speculate", "draftmodel", "crossdraft", "generate"]


def top_level_imports(path) -> set:
    """Names of the repository's top-level modules that the file imports (anywhere in it, lazily or not)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names & set(ORDER)


def test_library_modules_do_not_import_generate():
    code = f"import sys; import {', '.join(LIBRARY)}; print('generate' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"


def test_imports_flow_one_way():
    for i, name in enumerate(ORDER):
        later = top_level_imports(ROOT / f"{name}.py") - set(ORDER[:i])
        assert not later, f"{name}.py imports {sorted(later)}, which come after it (or itself)"


def test_no_import_cycle_among_top_level_modules():
    graph = {path.stem: top_level_imports(path) - {path.stem} for path in ROOT.glob("*.py")}

    def visit(name, stack):
        assert name not in stack, f"import cycle: {' -> '.join(stack + [name])}"
        for imported in graph.get(name, ()):
            visit(imported, stack + [name])

    for name in graph:
        visit(name, [])
