"""The package stays readable: no import cycle between its modules, no module past about 400 lines,
and docs/design.md names every module."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).parents[1] / "cogattn"


def _modules() -> dict[str, Path]:
    """Dotted name → file, for every module of the package (a package's name for its ``__init__.py``)."""
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """cogattn modules that ``name`` imports at module level (imports inside functions are lazy on purpose)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([base] if base else []))
            for alias in node.names:  # `from . import x` imports module x; `from .x import y` imports x
                target = f"{base}.{alias.name}"
                found.add(target if target in modules else base)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {m for m in found if m in modules and m != name}


def test_no_import_cycle():
    modules = _modules()
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    # a package's __init__ re-exports its modules: edges into an __init__ are fine, edges out of it are not cycles
    state: dict[str, int] = {}

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if modules[nxt].name == "__init__.py":
                continue
            if state.get(nxt) == 1:
                cycle = stack[stack.index(nxt) :] + [nxt] if nxt in stack else [node, nxt]
                raise AssertionError(f"import cycle: {' -> '.join(cycle)}")
            if nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    assert graph["cogattn.processor"] == set()  # the processor knows the recording only through its protocol


def test_modules_stay_small():
    sizes = {name: len(path.read_text().splitlines()) for name, path in _modules().items()}
    assert max(sizes.values()) <= 420, {n: s for n, s in sizes.items() if s > 420}


def test_design_document_names_every_module():
    design = (Path(__file__).parents[1] / "docs" / "design.md").read_text()
    for path in _modules().values():
        if path.name in ("__init__.py", "__main__.py"):
            continue
        short = path.relative_to(PACKAGE)
        shown = f"{short.parent}/" if len(short.parts) > 1 else path.name
        assert f"`{shown}`" in design or f"`{path.name}`" in design, f"docs/design.md does not mention {short}"
