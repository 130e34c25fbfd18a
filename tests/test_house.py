"""The package stays readable: no import cycle between its modules (imports inside functions count), no
import inside a function but of an optional or heavy dependency, no module past about 400 lines, and
docs/design.md names every module."""

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


# What a function may import when it runs: dependencies that are optional (triton, accelerate, ipywidgets,
# imageio and imageio-ffmpeg, fcntl on POSIX), slow to import for what needs them once (pandas, PIL, the hub client,
# tqdm, matplotlib's backends), or parts of diffusers and transformers only some versions have.
LAZY_OK = {
    "accelerate",
    "diffusers",
    "fcntl",
    "huggingface_hub",
    "imageio",
    "imageio_ffmpeg",
    "ipywidgets",
    "matplotlib",
    "pandas",
    "PIL",
    "tokenizers",
    "tqdm",
    "transformers",
    "triton",
}


def _nested_imports(path: Path):
    """Import statements inside functions (and classes) of a module."""
    tree = ast.parse(path.read_text())
    top = {id(node) for node in tree.body}
    for node in tree.body:  # a module-level try/if is module level too
        if isinstance(node, (ast.Try, ast.If)):
            top |= {id(n) for n in ast.walk(node) if isinstance(n, (ast.Import, ast.ImportFrom))}
    return [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom)) and id(n) not in top]


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """cogattn modules that ``name`` imports, at module level or inside a function."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    tree = ast.parse(path.read_text())
    typing_only = {  # `if TYPE_CHECKING:` imports never run: an annotation names its type without a cycle
        id(n)
        for node in tree.body
        if isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING")
        for n in ast.walk(node)
    }
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
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
    assert graph["cogattn.recorder.processor"] == set()  # the processor knows the recording only through its protocol


def test_imports_inside_functions_are_of_optional_dependencies_only():
    lazy = []
    for name, path in _modules().items():
        for node in _nested_imports(path):
            if isinstance(node, ast.ImportFrom) and node.level:
                lazy.append(f"{name}:{node.lineno} from {'.' * node.level}{node.module or ''}")
                continue
            top = (node.module if isinstance(node, ast.ImportFrom) else node.names[0].name).split(".")[0]
            if top not in LAZY_OK:
                lazy.append(f"{name}:{node.lineno} {top}")
    assert not lazy, f"imports inside functions of cogattn modules or required dependencies: {lazy}"


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
