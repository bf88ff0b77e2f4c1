"""The layout: imports flow one way, errors, kernels <- model <- tokenizer, grammar, quantize, tp <- decode <-
speculate <- draftmodel <- drafthead, crossdraft <- generation (the library) <- generate.py (the command line) <-
nothing: scripts and tests import the library, never the command line."""
import ast
import functools
import subprocess
import sys

from helpers import ROOT

# each imports only earlier ones
ORDER = ["errors", "artifacts", "kernels", "model", "tokenizer", "grammar", "quantize", "tp", "compilation", "decode",
         "speculate", "draftmodel", "drafthead", "crossdraft", "generation", "generate", "serve", "eval"]
LIBRARY = ORDER[:ORDER.index("generation") + 1]
ENTRY_POINTS = ORDER[len(LIBRARY):]  # run, never imported


@functools.cache
def parsed(path) -> ast.Module:
    """The file's syntax tree: every test of this module walks the same files."""
    return ast.parse(path.read_text())


def top_level_imports(path) -> set:
    """Names of the repository's top-level modules that the file imports (anywhere in it, lazily or not)."""
    names = set()
    for node in ast.walk(parsed(path)):
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


def test_nothing_imports_the_command_lines():
    """Scripts, tests and the library import generation.py; generate.py, serve.py and eval.py are only ever run
    (tests of a command line load its file, or import only what it defines beside main, as eval's tests do)."""
    files = [p for p in list(ROOT.glob("*.py")) + list(ROOT.glob("scripts/*.py")) + list(ROOT.glob("tests/*.py"))]
    importers = [str(p.relative_to(ROOT)) for p in files if not p.name.startswith("test_")
                 and (top_level_imports(p) & set(ENTRY_POINTS)) - {p.stem}]
    assert not importers, f"{importers} import a command line: import generation instead"
    tests = [str(p.relative_to(ROOT)) for p in ROOT.glob("tests/*.py") if "generate" in top_level_imports(p)]
    assert not tests, f"{tests} import generate.py: load it with helpers.load_cli, or test the library"


def test_model_file_holds_only_the_model():
    """model.py imports torch and the two small helper modules only, and defines no CLI or file writing."""
    assert top_level_imports(ROOT / "model.py") <= {"errors", "kernels"}
    source = (ROOT / "model.py").read_text()
    assert "argparse" not in source and "write_atomically" not in source and "run_cli" not in source


def test_no_import_cycle_among_top_level_modules():
    graph = {path.stem: top_level_imports(path) - {path.stem} for path in ROOT.glob("*.py")}

    def visit(name, stack):
        assert name not in stack, f"import cycle: {' -> '.join(stack + [name])}"
        for imported in graph.get(name, ()):
            visit(imported, stack + [name])

    for name in graph:
        visit(name, [])


# the front-page documents stay readable at a glance; history goes to docs/ (KiB: 1024 bytes)
DOCUMENT_LIMITS = {"README.md": 12 * 1024, "BENCHMARKS.md": 30 * 1024}


def test_front_page_documents_stay_short():
    """README.md is a user's guide and BENCHMARKS.md one table of today's figures per goal: details belong in docs/,
    earlier runs in docs/benchmark-history.md."""
    for name, limit in DOCUMENT_LIMITS.items():
        size = (ROOT / name).stat().st_size
        assert size <= limit, (f"{name} is {size} bytes, over its {limit} ({limit // 1024} KiB): move details to "
                               f"docs/ (earlier benchmark runs to docs/benchmark-history.md)")


MAX_FUNCTION_LINES = 90


def function_lengths(path) -> list:
    """(qualified name, lines from its def to the last line of its body) of every function in the file; a nested
    function counts inside its parent and is listed too."""
    found = []

    def walk(node, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                found.append((prefix + child.name, child.end_lineno - child.lineno + 1))
                walk(child, prefix + child.name + ".")
            elif isinstance(child, ast.ClassDef):
                walk(child, prefix + child.name + ".")
            else:
                walk(child, prefix)
    walk(parsed(path), "")
    return found


def test_function_lengths_are_measured_from_def_to_last_line(tmp_path):
    source = tmp_path / "sample.py"
    source.write_text("def outer():\n    def inner():\n        return 1\n    return inner\n\n\n"
                      "class A:\n    async def method(self):\n        pass\n")
    assert function_lengths(source) == [("outer", 4), ("outer.inner", 2), ("A.method", 2)]


def test_no_function_is_longer_than_its_steps():
    """The library, the command lines and the scripts read as named steps: a function over MAX_FUNCTION_LINES lines
    is cut at its seams."""
    files = sorted(ROOT.glob("*.py")) + sorted(ROOT.glob("scripts/*.py"))
    long = [f"{path.relative_to(ROOT)}:{name} ({lines} lines)" for path in files
            for name, lines in function_lengths(path) if lines > MAX_FUNCTION_LINES]
    assert not long, f"longer than {MAX_FUNCTION_LINES} lines: {', '.join(long)}: cut them into named steps"
