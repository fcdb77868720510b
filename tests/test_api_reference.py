"""Every public name has a page in the API reference.

Oracle: each module's ``__all__`` against the names its page under
``docs/api/`` lists in its ``autosummary`` directives (read from the sources;
Sphinx is not built here). A name documented on another page counts when it
is the same object there (``qkvnp.layers.SelfAttention`` is
``qkvnp.SelfAttention``: a class gets one page), and a module of ``__all__``
counts when it has its own page.
"""
import importlib
import inspect
import re
from pathlib import Path

import pytest

API = Path(__file__).resolve().parents[1] / "docs" / "api"

#: The modules whose public names the reference must document, and which of
#: their names it need not (with why).
MODULES = {
    "qkvnp": {"__version__": "a string, stated in the page's introduction"},
    "qkvnp.functional": {},
    "qkvnp.ops.positions": {},
    "qkvnp.ops.variants": {},
    "qkvnp.ops.overflow": {},
    "qkvnp.layers": {},
    "qkvnp.gradcheck": {},
    "qkvnp.interop": {},
    "qkvnp.kernels": {
        # the layers' own machinery, not a setting a user changes
        "check_impl": "internal",
    },
    "qkvnp.training": {},
    "qkvnp.losses": {},
    "qkvnp.optim": {},
}


def documented():
    """``{page module: [names its autosummary lists]}`` from docs/api/*.rst."""
    pages = {}
    for path in sorted(API.glob("*.rst")):
        text = path.read_text(encoding="utf-8")
        module = re.search(r"^\.\. module:: (\S+)", text, flags=re.M)
        if module is None:
            continue
        names = []
        for block in re.findall(r"^\.\. autosummary::\n((?:   .*\n|\n)*)", text, flags=re.M):
            names += [line.strip() for line in block.splitlines()
                      if line.strip() and not line.strip().startswith(":")]
        pages[module[1]] = names
    return pages


def test_every_page_is_in_the_index():
    index = (API / "index.rst").read_text(encoding="utf-8")
    for path in API.glob("*.rst"):
        if path.name != "index.rst":
            assert f"   {path.stem}\n" in index, f"{path.name} is not in docs/api/index.rst"


@pytest.mark.parametrize("module_name", sorted(MODULES))
def test_every_public_name_has_a_page(module_name):
    pages = documented()
    assert module_name in pages, f"no page in docs/api/ declares .. module:: {module_name}"
    objects = {id(getattr(importlib.import_module(page), name))
               for page, names in pages.items() for name in names}
    module = importlib.import_module(module_name)
    exempt = MODULES[module_name]
    missing = []
    for name in module.__all__:
        value = getattr(module, name)
        if name in exempt or name in pages[module_name] or id(value) in objects:
            continue
        if getattr(value, "__name__", None) in pages and hasattr(value, "__all__"):
            continue  # a module with a page of its own
        missing.append(name)
    assert not missing, f"{module_name}: no API page for {missing}"


def test_pages_list_only_public_names():
    for page, names in documented().items():
        module = importlib.import_module(page)
        unknown = [name for name in names if name not in module.__all__]
        assert not unknown, f"docs/api page of {page} lists names outside __all__: {unknown}"


def _public_classes():
    for module_name in MODULES:
        module = importlib.import_module(module_name)
        for name in module.__all__:
            value = getattr(module, name)
            if isinstance(value, type):
                yield f"{module_name}.{name}", value


@pytest.mark.parametrize("name, cls", sorted(set(_public_classes())), ids=lambda v: str(v))
def test_a_class_shows_its_constructors_signature(name, cls):
    # Oracle: what autodoc shows. It takes the first __new__ below object's
    # before __init__: a Layer.__new__(cls, *args, **kwargs) once hid every
    # layer's parameters behind "(*args, **kwargs)".
    init = inspect.signature(cls.__init__)
    named = [p for p in init.parameters.values()
             if p.name != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    if not named:
        return
    for klass in cls.__mro__:
        if "__new__" in vars(klass) and klass is not object:
            new = inspect.signature(vars(klass)["__new__"])
            kinds = {p.kind for p in new.parameters.values()}
            assert not {inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD} <= kinds, (
                f"{name}: {klass.__name__}.__new__{new} hides __init__{init}")
            break
    shown = inspect.signature(cls)
    assert [p.name for p in shown.parameters.values()] == [p.name for p in named], name


#: The modules whose public classes must describe every constructor parameter.
DESCRIBED = ("qkvnp", "qkvnp.layers", "qkvnp.training", "qkvnp.optim")
#: Classes exempt, with why. Exceptions take the message, as every exception does.
UNDESCRIBED: dict = {}


def _described_classes():
    for module_name in DESCRIBED:
        module = importlib.import_module(module_name)
        for name in module.__all__:
            value = getattr(module, name)
            if (isinstance(value, type) and value.__init__ is not object.__init__
                    and not issubclass(value, BaseException)
                    and f"{module_name}.{name}" not in UNDESCRIBED):
                yield f"{module_name}.{name}", value


def _described_names(cls):
    """The names a class docstring's Parameters section describes (numpydoc's reading).

    An entry counts when it has a description under its name and type line:
    ``rng : numpy.random.Generator or int, optional`` alone describes nothing.
    """
    from numpydoc.docscrape import ClassDoc

    names = set()
    for parameter in ClassDoc(cls, config={"show_class_members": False})["Parameters"]:
        if not "".join(parameter.desc).strip():
            continue
        # "a, b, c : ..." describes each; "*args" and "**kwargs" are their names
        names.update(part.strip().lstrip("*") for part in parameter.name.split(","))
    return names


@pytest.mark.parametrize("name, cls", sorted(set(_described_classes())), ids=lambda v: str(v))
def test_every_constructor_parameter_is_described(name, cls):
    # Oracle: the signature the API reference shows (``inspect.signature``)
    # against the class docstring's Parameters section, as numpydoc parses it.
    # ``rng`` and ``dtype`` once had a type and no description on the layers.
    pytest.importorskip("numpydoc")
    named = [p.name for p in inspect.signature(cls).parameters.values()
             if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    missing = [p for p in named if p not in _described_names(cls)]
    assert not missing, f"{name}'s docstring does not describe {missing}"
