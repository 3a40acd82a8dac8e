"""The package's shape: imports point one way through the layers, no package imports
itself back through another, the top level stays small, the speed laboratory (benchmarks/)
stays beside the library, and nothing cites files that a clone of the repository does not
have."""

import ast
import pathlib
import re
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "rspc_jax"

# Bottom to top: a unit may import its own layer's units' modules only where listed in
# the same tuple, and any unit of a lower layer.
LAYERS = (
    ("models", "parallel"),
    ("rspc",),
    ("data",),
    ("interop",),
    ("evaluation",),
    ("training",),
    ("tools",),
    ("main", "evaluate", "analyze", "export", "study", "plan"),
)
MAX_TOP_LEVEL = 14


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported_names(path: pathlib.Path) -> set[str]:
    """Every module name `path` imports (absolute, as written), at module level or inside
    functions."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            found.add(node.module)
    return found


def _imports(path: pathlib.Path) -> set[str]:
    """Every rspc_jax module `path` imports, at module level or inside functions."""
    module = _module_name(path)
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(
                    package.split(".")[: len(package.split(".")) - node.level + 1]
                    + ([base] if base else [])
                )
            for alias in node.names:
                candidate = f"{base}.{alias.name}"
                is_module = any(
                    (ROOT / candidate.replace(".", "/")).with_suffix(s).exists()
                    for s in (".py", "")
                )
                found.add(candidate if is_module else base)
    return {name for name in found if name == "rspc_jax" or name.startswith("rspc_jax.")}


def _graph() -> dict[str, set[str]]:
    return {_module_name(p): _imports(p) for p in PACKAGE.rglob("*.py")}


def _package_of(module: str) -> str:
    """The package a module belongs to; a top-level module is a unit of its own."""
    if (ROOT / module.replace(".", "/")).is_dir():
        return module
    parent = module.rsplit(".", 1)[0]
    return module if parent == "rspc_jax" else parent


def _top_unit(module: str) -> str:
    return module.split(".")[1] if module.count(".") else module


def _find_cycle(edges: dict[str, set[str]]):
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for other in sorted(edges.get(node, ())):
            if state.get(other) == "open":
                return stack[stack.index(other) :] + [other]
            if other not in state:
                cycle = visit(other)
                if cycle:
                    return cycle
        state[node] = "done"
        stack.pop()
        return None

    for node in sorted(edges):
        if node not in state:
            cycle = visit(node)
            if cycle:
                return cycle
    return None


def _package_cycle(graph: dict[str, set[str]]):
    edges: dict[str, set[str]] = {}
    for module, imported in graph.items():
        source = _package_of(module)
        for target in imported:
            target_package = _package_of(target)
            if target_package not in (source, "rspc_jax"):
                edges.setdefault(source, set()).add(target_package)
    return _find_cycle(edges)


def _upward_imports(graph: dict[str, set[str]]) -> list[str]:
    rank = {unit: i for i, layer in enumerate(LAYERS) for unit in layer}
    return sorted(
        f"{module} -> {target}"
        for module, imported in graph.items()
        if module != "rspc_jax"
        for target in imported
        if target != "rspc_jax"
        and _top_unit(target) != _top_unit(module)
        and rank[_top_unit(target)] >= rank[_top_unit(module)]
    )


def test_no_package_level_import_cycle():
    cycle = _package_cycle(_graph())
    assert cycle is None, f"import cycle between packages: {' -> '.join(cycle)}"


def test_imports_point_down_the_layers():
    rank = {unit for layer in LAYERS for unit in layer}
    units = {_top_unit(m) for m in _graph() if m != "rspc_jax"}
    assert units <= rank, f"top-level units without a layer: {sorted(units - rank)}"
    upward = _upward_imports(_graph())
    assert not upward, "imports that do not point to a lower layer:\n" + "\n".join(upward)


def _laboratory_imports(paths) -> list[str]:
    """'module -> name' for every import of the benchmarks package among `paths`."""
    return sorted(
        f"{_module_name(path)} -> {name}"
        for path in paths
        for name in _imported_names(path)
        if name == "benchmarks" or name.startswith("benchmarks.")
    )


def test_the_library_never_imports_the_speed_laboratory():
    """Training, evaluation and the models run without benchmarks/: nothing under
    rspc_jax/ imports it (the check itself is shown to catch such an import)."""
    offending = _laboratory_imports(PACKAGE.rglob("*.py"))
    assert not offending, "rspc_jax imports benchmarks/:\n" + "\n".join(offending)
    assert (ROOT / "benchmarks" / "__init__.py").is_file()
    laboratory = _laboratory_imports((ROOT / "benchmarks").rglob("*.py"))
    assert "benchmarks.train_step -> benchmarks" in laboratory  # the check sees imports


def test_the_library_never_imports_the_official_code_scripts():
    """reference/ runs the official PyTorch code for developers; nothing in rspc_jax/ or
    tests/ imports it (tests read only what it wrote into tests/fixtures/)."""
    paths = [*PACKAGE.rglob("*.py"), *(ROOT / "tests").rglob("*.py")]
    offending = sorted(
        f"{path.relative_to(ROOT)} -> {name}"
        for path in paths
        for name in _imported_names(path)
        if name == "reference" or name.startswith("reference.")
    )
    assert not offending, "imports of reference/:\n" + "\n".join(offending)


# Declarations of every config field, read as a table rather than as steps.
LONG_FUNCTIONS_ALLOWED = {("training/defaults.py", "get_default_config")}
MAX_FUNCTION_LINES = 80


def _long_functions(path: pathlib.Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            lines = node.end_lineno - node.lineno + 1
            where = (str(path.relative_to(PACKAGE)), node.name)
            if lines > MAX_FUNCTION_LINES and where not in LONG_FUNCTIONS_ALLOWED:
                found.append(f"{where[0]}:{node.name} ({lines} lines)")
    return found


def test_every_function_fits_on_one_screen():
    long = [entry for path in sorted(PACKAGE.rglob("*.py")) for entry in _long_functions(path)]
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines:\n" + "\n".join(long)


def test_the_models_read_no_environment_variables():
    """Backend choices are made in code (models/ops.py), not by variables read at import."""
    offending = [
        f"{path.relative_to(ROOT)}:{number}"
        for path in sorted((PACKAGE / "models").rglob("*.py"))
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if re.search(r"os\.environ|os\.getenv|getenv\(", line)
    ]
    assert not offending, offending


def test_the_top_level_is_small():
    entries = sorted(
        p.stem
        for p in PACKAGE.iterdir()
        if p.name != "__init__.py"
        and not p.name.startswith(("_", "."))
        and (p.suffix == ".py" or (p / "__init__.py").exists())
    )
    assert len(entries) <= MAX_TOP_LEVEL, entries


def test_the_checks_catch_upward_imports_and_cycles():
    """The checkers themselves, on made-up graphs of real package names."""
    assert _upward_imports({"rspc_jax.models.vit": {"rspc_jax.training.loop"}}) == [
        "rspc_jax.models.vit -> rspc_jax.training.loop"
    ]
    assert _upward_imports({"rspc_jax.training.loop": {"rspc_jax.models.vit"}}) == []
    assert _package_cycle(
        {
            "rspc_jax.evaluation.loop": {"rspc_jax.evaluation.analysis.tables"},
            "rspc_jax.evaluation.analysis.tables": {"rspc_jax.evaluation.loop"},
        }
    ) == ["rspc_jax.evaluation", "rspc_jax.evaluation.analysis", "rspc_jax.evaluation"]


_OUTSIDE = re.compile(
    r"rspc-method\.md|eval-protocols\.md|jax-stack\.md|style-anchors\.md"
    r"|architectures\.md|shared/reference(?!/fixtures)|/work/"
)


def test_nothing_cites_files_outside_the_repository():
    try:
        tracked = subprocess.run(
            ["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.split()
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout: cannot list the repository's files")
    offending = []
    for name in tracked:
        if pathlib.Path(name).suffix not in (".py", ".md", ".sh", ".ipynb", ".toml", ".txt"):
            continue
        for number, line in enumerate((ROOT / name).read_text().splitlines(), 1):
            if _OUTSIDE.search(line) and name != "tests/test_architecture.py":
                offending.append(f"{name}:{number}: {line.strip()[:100]}")
    assert not offending, "citations of files outside the repository:\n" + "\n".join(offending)
