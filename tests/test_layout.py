"""The package's layout holds: no import circle between its modules, no module importing
from a layer above its own, no module past about 400 lines, at most 16 modules directly in
``gateway/`` (the top floor shows the layers), the gateway's own code never importing the
fakes of ``gateway.testing``, and the admin port never importing a capability's modules
(it reads them through the registry, by keys typed in ``snapshot``).  Imports are read from the
source (every ``import`` and ``from ... import`` of ``gateway``, also those inside functions
and ``TYPE_CHECKING`` blocks), so the check needs nothing to run."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "gateway"

LAYERS: tuple[tuple[str, ...], ...] = (
    # 0. the base every part may use
    (
        "errors",
        "clock",
        "lazy",
        "tenant",
        "metrics",
        "state",
        "wire",
        "data",
    ),
    # 1. the policy model, telemetry, the OpenAI wire format, the pipeline's types, routing,
    #    request traces, the simulated model server (which stands on its own), and the one
    #    Redis layer every user of shared state goes through
    ("policy", "telemetry", "openai", "pipeline", "tracing", "sim", "redis"),
    # 2. the two edges of the data plane: the server clients talk to, the transport to backends
    ("server", "transport"),
    # 3. what a request and the stages share at run time
    ("runtime", "snapshot"),
    # 4. the capabilities, each a package with its stage
    ("cache", "coalesce", "batching", "mirror", "resilience", "pool"),
    # 5. the pipeline's order, and the edge that runs it
    ("stages", "edge"),
    # 6. the admin port, the app that owns everything, and the supervisor of its workers
    ("admin", "app", "workers"),
    # 7. what drives the app: the command line, the demo, and the fakes for tests
    ("cli", "__main__", "serve", "demo", "testing"),
)
MAX_LINES = 420  # "about 400": a module past it is split
MAX_TOP_MODULES = 16
CAPABILITIES = ("cache", "coalesce", "batching", "mirror", "resilience", "pool")


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path, name: str) -> set[str]:
    tree = ast.parse(path.read_text(), str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] == "gateway")
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against this module's package
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join([*base, *([node.module] if node.module else [])])
            else:
                target = node.module or ""
            if target.split(".")[0] != "gateway":
                continue
            found.add(target)
            for alias in node.names:  # `from gateway.x import y` may name a module y
                found.add(f"{target}.{alias.name}")
    return found


def graph() -> dict[str, set[str]]:
    modules = {module_name(p): p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts}
    edges: dict[str, set[str]] = {}
    for name, path in modules.items():
        edges[name] = {t for t in imports_of(path, name) if t in modules and t != name}
    return edges


def layer_of(module: str) -> int:
    top = module.split(".")[1] if "." in module else ""
    for index, names in enumerate(LAYERS):
        if top in names:
            return index
    raise AssertionError(f"{module}: in no layer of tests/test_layout.py")


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, ()):
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

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def test_the_circle_finder_finds_circles():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_no_import_circle():
    edges = {m: {t for t in ts if not _package_face(t, m)} for m, ts in graph().items()}
    assert circles(edges) == []


def _package_face(target: str, importer: str) -> bool:
    """A package's ``__init__`` re-exporting its own modules is not a circle with them."""
    return (
        importer.startswith(target + ".")
        and (PACKAGE.parent / target.replace(".", "/") / "__init__.py").exists()
    )


def test_no_import_from_a_higher_layer():
    upward = [
        f"{m} (layer {layer_of(m)}) imports {t} (layer {layer_of(t)})"
        for m, targets in sorted(graph().items())
        if m != "gateway"
        for t in sorted(targets)
        if t != "gateway" and layer_of(t) > layer_of(m)
    ]
    assert upward == []


def test_every_part_of_the_package_is_in_a_layer():
    for module in graph():
        if module != "gateway":
            layer_of(module)


def test_no_module_is_past_about_400_lines():
    long = {
        str(p.relative_to(PACKAGE.parent)): n
        for p in PACKAGE.rglob("*.py")
        if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert long == {}


def test_the_top_floor_holds_at_most_16_modules():
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(top) <= MAX_TOP_MODULES, top


def test_the_gateways_own_code_never_imports_the_fakes():
    """The fakes (``gateway.testing``, the harness with them) are for tests: production code
    importing them would ship them as the gateway's behaviour.  ``gateway.testing.llama`` is
    no fake but the launcher of llama.cpp's real server, which ``gateway demo --backend
    llama`` starts as the tests do."""
    real = {"gateway.testing.llama"}
    production = {
        m: ts for m, ts in graph().items() if m != "gateway" and not m.startswith("gateway.testing")
    }
    found = [
        f"{m} imports {t}"
        for m, targets in sorted(production.items())
        for t in sorted(targets)
        if (t == "gateway.testing" or t.startswith("gateway.testing.")) and t not in real
    ]
    assert found == []


def test_the_admin_port_reads_the_capabilities_through_the_registry_only():
    found = [
        f"{m} imports {t}"
        for m, targets in sorted(graph().items())
        if m.startswith("gateway.admin")
        for t in sorted(targets)
        if t.split(".")[1] in CAPABILITIES
    ]
    assert found == []


def test_the_admins_typed_keys_are_the_capabilities_own():
    from gateway.cache.embedding_seam import OPERATING_POINTS
    from gateway.cache.state import CACHE_STATE
    from gateway.resilience.gpu import GPU_CONTROL
    from gateway.resilience.standings import STANDINGS
    from gateway.snapshot import CACHE, CACHE_OPERATING_POINTS, TENANT_STANDINGS, THROTTLE

    assert (CACHE, THROTTLE, CACHE_OPERATING_POINTS, TENANT_STANDINGS) == (
        CACHE_STATE,
        GPU_CONTROL,
        OPERATING_POINTS,
        STANDINGS,
    )
