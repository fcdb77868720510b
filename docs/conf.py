"""Sphinx configuration of qkvnp's documentation.

Build: ``pip install -e '.[docs]'`` then
``python -m sphinx -W --keep-going -b html docs docs/_build/html``.
The build runs every script of ``examples/`` (sphinx-gallery).
"""
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# document the checkout the docs sit in, installed or not
sys.path.insert(0, str(ROOT))
os.environ.setdefault("MPLBACKEND", "Agg")

import qkvnp  # noqa: E402

project = "qkvnp"
author = "qkvnp developers"
copyright = "2026, qkvnp developers"
version = release = qkvnp.__version__

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.mathjax",
    # MathJax 3 itself, copied into _static/mathjax: formulas render offline
    "sphinx-mathjax-offline",
    "numpydoc",
    "myst_parser",
    "sphinx_gallery.gen_gallery",
]

# NOTE: the copy that sphinx-mathjax-offline ships, relative to _static; the
# default is a CDN's, and offline every formula would stay raw TeX
mathjax_path = "mathjax/tex-chtml.js"

source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
exclude_patterns = ["_build", "**.ipynb_checkpoints", "sg_execution_times.rst"]

# Markdown pages: $...$ and $$...$$ math, GitHub-style heading anchors
myst_enable_extensions = ["dollarmath", "amsmath"]
myst_heading_anchors = 3

# API reference
templates_path = ["_templates"]
autosummary_generate = True
autodoc_default_options = {"members": False}
# the numpydoc sections give each parameter's type with its shape; the
# signatures' hints (numpy.typing aliases) would only repeat them, as links
# that need numpy's inventory, which the build cannot fetch offline
autodoc_typehints = "none"
numpydoc_show_class_members = False
numpydoc_class_members_toctree = False
# NOTE: type lines stay text: they hold shapes, "(B, T, E)", which are no
# objects to link, and the numpy and Python inventories would need the network
# at build time (intersphinx)
numpydoc_xref_param_type = False

# A broken cross-reference fails the build. Nothing is ignored: the type lines
# are text (above), and docstrings name private objects as literals.
nitpicky = True

# Gallery: examples/*.py, run at build time with their figures
sphinx_gallery_conf = {
    "examples_dirs": str(ROOT / "examples"),
    "gallery_dirs": "auto_examples",
    "filename_pattern": r"/.*\.py$",      # run every example, not only plot_*
    "download_all_examples": False,
    "remove_config_comments": True,
    "matplotlib_animations": False,
    "within_subsection_order": "FileNameSortKey",
}

html_theme = "pydata_sphinx_theme"
html_title = f"qkvnp {release}"
html_theme_options = {
    "navigation_with_keys": False,
    "show_toc_level": 2,
}
html_static_path = []
