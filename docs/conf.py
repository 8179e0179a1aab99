"""Sphinx configuration of the torchgpipe documentation.

Build (warnings are errors, every cross-reference checked)::

    python -m pip install -q -e ".[docs]"
    python -m sphinx -W --keep-going -n -b html docs docs/_build/html

The diagrams under ``_static/`` are SVG files drawn by ``diagrams.py``. They
are committed, and redrawn at every build when matplotlib is installed (the
drawing is deterministic, so an unchanged script leaves them unchanged).
"""
import os
import runpy
import sys

DOCS = os.path.dirname(os.path.abspath(__file__))

# Document the checkout this file belongs to, installed or not.
sys.path.insert(0, os.path.dirname(DOCS))

import torchgpipe  # noqa: E402

# -- Project information -----------------------------------------------------

project = 'torchgpipe'
author = 'torchgpipe contributors'
copyright = 'torchgpipe contributors'
release = torchgpipe.__version__
version = '.'.join(release.split('.')[:2])

# -- General configuration ---------------------------------------------------

extensions = [
    'sphinx.ext.autodoc',
    'sphinx.ext.napoleon',
]

exclude_patterns = ['_build']
templates_path: list = []

# Docstrings are Google style ("Args:", "Returns:", "Raises:").
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False

autodoc_member_order = 'bysource'
# Autograd functions would inherit torch's long forward/backward docstrings.
autodoc_inherit_docstrings = False
autodoc_typehints = 'signature'
# Keep the package's own aliases readable in signatures.
autodoc_type_aliases = {
    'TensorOrTensors': 'torchgpipe.microbatch.TensorOrTensors',
    'Tensors': 'torchgpipe.microbatch.Tensors',
    'Device': 'torchgpipe.gpipe.Device',
    'Devices': 'torchgpipe.gpipe.Devices',
}

# Every cross-reference must resolve. There is no network at build time, so no
# intersphinx: references into Python, typing and PyTorch cannot be resolved,
# and are listed here instead. Everything in torchgpipe must resolve.
nitpicky = True
nitpick_ignore_regex = [
    # PyTorch, and what it re-exports.
    (r'py:.*', r'(torch|Tensor|nn|F)(\..*)?'),
    # The standard library and typing.
    (r'py:.*', r'(typing|collections|contextlib|threading|queue|types|abc|numbers|copy)\..*'),
    (r'py:.*', r'(Any|Callable|ContextManager|Deque|Dict|FrozenSet|Generator|Iterable|'
               r'Iterator|List|Optional|Protocol|Sequence|Set|Tuple|Type|TypeVar|Union|'
               r'ClassVar|T)'),
    (r'py:.*', r'(None|NoneType|bool|int|float|str|bytes|object|type|list|tuple|dict|set|'
               r'frozenset|slice|BaseException|Exception|[A-Za-z]*Error)'),
    # Plain-English types in docstrings: "list of ints", "iterable of devices"...
    (r'py:class', r'(ints|strs|floats|tensors|tensor|devices|iterable|sequence|optional|'
                  r'function|callable|lists|generator|one|of|or|module|this|itself)'),
    (r'py:class', r"'cpu'|'cuda'|'cuda' device|device"),
    # Internal type aliases without a docstring of their own.
    (r'py:class', r'torchgpipe\..*\.T'),  # TypeVars
    (r'py:.*', r'torchgpipe\.(microbatch\.(TensorOrTensors|Tensors)|gpipe\.Devices?|'
               r'checkpoint\.(Function|Recomputed|RNGStates|AutocastStates)|'
               r'worker\.(ExcInfo|Result))'),
]

# -- HTML output -------------------------------------------------------------

html_theme = 'furo'
html_title = f'torchgpipe {release}'
html_static_path = ['_static']


# -- Diagrams ----------------------------------------------------------------

def _draw_diagrams() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return  # The committed SVGs are used as they are.
    runpy.run_path(os.path.join(DOCS, 'diagrams.py'), run_name='__main__')


_draw_diagrams()
