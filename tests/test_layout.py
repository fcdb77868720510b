"""The package's architecture, read from its source with ``ast`` (nothing guessed).

Data flows one way, down the tiers of :data:`TIERS`: the apps, interop,
the models, the layers, the kernels, the reference ops, the helpers. Oracles: the import graph of every
module (imports inside functions count), which must have no cycle, no
``_private`` name taken from another module except from the three shared
helpers, and no module over 700 lines; each module's ``__all__`` must name
what it defines.
"""
import ast
import importlib
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "qkvnp"
SHARED_PRIVATE = {"qkvnp._checks", "qkvnp._io", "qkvnp.kernels._runtime"}
MAX_LINES = 700


def _module_name(path):
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _import_target(package, node):
    """The absolute module a ``from ... import`` in ``package`` names (relative levels resolved)."""
    if not node.level:
        return node.module
    base = package
    for _ in range(node.level - 1):
        base = base.rpartition(".")[0]
    return f"{base}.{node.module}" if node.module else base


def _imports(name):
    """``(imported module, imported name or None)`` for every import in ``name``'s source."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found += [(alias.name, None) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            target = _import_target(package, node)
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                found.append((sub, None) if sub in MODULES else (target, alias.name))
    return [(module, imported) for module, imported in found if module in MODULES and module != name]


GRAPH = {name: sorted({module for module, _ in _imports(name)}) for name in MODULES}


def _cycles():
    """Every import cycle as a list of modules (a package importing its own
    submodules is not one; a submodule importing its package is an edge)."""
    cycles, state = [], {}

    def visit(node, path):
        state[node] = "open"
        for nxt in GRAPH[node]:
            if MODULES[nxt].name == "__init__.py" and node.startswith(nxt + "."):
                continue  # qkvnp.kernels.fast -> qkvnp.kernels is how Python loads it, not a cycle
            if state.get(nxt) == "open":
                cycles.append(path[path.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = "done"

    for name in MODULES:
        if name not in state:
            visit(name, [name])
    return cycles


def test_no_import_cycle():
    assert _cycles() == []


def test_no_private_name_crosses_a_module_boundary():
    crossings = [(name, f"{module}.{imported}") for name in MODULES
                 for module, imported in _imports(name)
                 if imported and imported.startswith("_") and not imported.startswith("__")
                 and module not in SHARED_PRIVATE]
    assert crossings == []


def _module_aliases(name):
    """Local names bound to qkvnp modules in ``name``'s source (``from . import functional as F``)."""
    aliases = {}
    package = name if MODULES[name].name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(MODULES[name].read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom):
            target = _import_target(package, node)
            for alias in node.names:
                if f"{target}.{alias.name}" in MODULES:
                    aliases[alias.asname or alias.name] = f"{target}.{alias.name}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in MODULES and alias.asname:
                    aliases[alias.asname] = alias.name
    return aliases


def test_no_private_name_is_used_through_a_module():
    """``F._linear_backward`` is a private crossing too, even without an import of the name."""
    crossings = []
    for name in MODULES:
        aliases = _module_aliases(name)
        for node in ast.walk(ast.parse(MODULES[name].read_text(encoding="utf-8"))):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                    and node.value.id in aliases and node.attr.startswith("_")
                    and not node.attr.startswith("__")
                    and aliases[node.value.id] not in SHARED_PRIVATE):
                crossings.append(f"{name}: {node.value.id}.{node.attr}")
    assert crossings == []


#: The tiers, bottom up: a module imports only from its own tier or below.
TIERS = [
    ("helpers", ("qkvnp._checks", "qkvnp._io", "qkvnp._typing")),
    ("ops", ("qkvnp.ops", "qkvnp.functional")),
    ("kernels", ("qkvnp.kernels",)),
    ("layers", ("qkvnp.layers", "qkvnp.losses", "qkvnp.optim")),
    ("models", ("qkvnp.models",)),
    ("interop", ("qkvnp.interop",)),
    ("apps", ("qkvnp.training", "qkvnp.gradcheck", "qkvnp.apps")),
    ("entry points", ("qkvnp.__main__", "qkvnp")),
]


def _tier(name):
    for rank, (_, prefixes) in enumerate(TIERS):
        if any(name == p or name.startswith(p + ".") for p in prefixes if p != "qkvnp"):
            return rank
    assert name == "qkvnp", f"{name} belongs to no tier of TIERS"
    return len(TIERS) - 1


def test_every_import_runs_down_the_tiers():
    """Ops import no kernel, kernels no layer, layers no model, nothing the apps
    (the direction of the data flow, and what docs/layout.md draws)."""
    upward = [(n, m) for n in MODULES for m, imported in _imports(n)
              if _tier(m) > _tier(n) and (m, imported) != ("qkvnp", "__version__")]
    assert upward == []


def test_the_package_root_keeps_the_entry_points_and_little_else():
    root = [n for n in MODULES if n.count(".") == 1 and MODULES[n].name != "__init__.py"
            and n != "qkvnp.__main__"]
    assert len(root) <= 8, root


@pytest.mark.parametrize("name", sorted(MODULES))
def test_module_is_short_enough_to_read_in_one_sitting(name):
    lines = MODULES[name].read_text(encoding="utf-8").count("\n")
    assert lines <= MAX_LINES, f"{name}: {lines} lines > {MAX_LINES}"


@pytest.mark.parametrize("name", sorted(set(MODULES) - {"qkvnp.__main__"}))
def test_module_states_its_public_surface(name):
    module = importlib.import_module(name)
    assert isinstance(getattr(module, "__all__", None), list), f"{name} has no __all__ list"
    missing = [public for public in module.__all__ if not hasattr(module, public)]
    assert missing == [], f"{name}.__all__ names what it does not define: {missing}"
    assert not [p for p in module.__all__ if p.startswith("_") and p != "__version__"]


def test_graph_listing_is_readable():
    """The listing the redesign note quotes: every module and what it imports."""
    listing = "\n".join(f"{name}: {', '.join(GRAPH[name]) or '-'}" for name in sorted(GRAPH))
    assert "qkvnp.kernels.tiled: " in listing and "qkvnp.kernels.fast" not in \
        listing.split("qkvnp.kernels.tiled: ")[1].split("\n")[0]  # tiled never imports fast
