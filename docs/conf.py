"""Sphinx configuration of the torchgpipe documentation.

Build (warnings are errors, every cross-reference checked) with the command
README.md gives beside the test command (CI runs it there, in a fresh venv),
here on two lines::

    python -m pip install -q torch==2.13.0 -e ".[docs]"
    python -m sphinx -W --keep-going -n -b html docs docs/_build/html

The diagrams under ``_static/`` are SVG files drawn by ``diagrams.py``. They
are committed, and redrawn at every build when matplotlib is installed (the
drawing is deterministic, so an unchanged script leaves them unchanged).
"""
import ast
import os
import runpy
import sys
from typing import Any, Dict, List, Optional, Sequence, Tuple

from docutils import nodes
from docutils.parsers.rst.states import Inliner
from sphinx import addnodes
from sphinx.application import Sphinx
from sphinx.transforms.post_transforms import SphinxPostTransform

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

# A literal block is Python only when it says so (``.. code-block:: python``):
# the pages' ``::`` blocks are output, formulas and diagrams. Docstrings, which
# cannot say so, are sorted by ``_highlight_docstring_blocks`` below.
highlight_language = 'text'

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
    'TensorOrTensors': 'torchgpipe.foundation.microbatch.TensorOrTensors',
    'Tensors': 'torchgpipe.foundation.microbatch.Tensors',
    'Device': 'torchgpipe.foundation.validation.Device',
    'Devices': 'torchgpipe.foundation.validation.Devices',
    'LossFunction': 'torchgpipe.engine.step.LossFunction',
}

# Every cross-reference must resolve. There is no network at build time, so no
# intersphinx: references into Python, typing and PyTorch cannot be resolved,
# and are listed here instead. Everything in torchgpipe must resolve.
nitpicky = True
nitpick_ignore_regex = [
    # PyTorch, and what it re-exports.
    (r'py:.*', r'(torch|Tensor|nn|F)(\..*)?'),
    # The standard library and typing.
    (r'py:.*', r'(typing|collections|contextlib|threading|queue|types|abc|numbers|copy|os|'
               r'pathlib|fractions)\..*'),
    (r'py:.*', r'(Any|Callable|ContextManager|Deque|Dict|FrozenSet|Generator|Iterable|'
               r'Iterator|List|Optional|Protocol|Sequence|Set|Tuple|Type|TypeVar|Union|'
               r'ClassVar|T)'),
    (r'py:.*', r'(None|NoneType|bool|int|float|str|bytes|object|type|list|tuple|dict|set|'
               r'frozenset|slice|BaseException|Exception|[A-Za-z]*Error)'),
    # Plain words in docstring types that ``_unlink_plain_words`` cannot tell
    # from names: "'cpu' or 'cuda' device".
    (r'py:class', r"'cpu'|'cuda'|'cuda' device"),
    # Internal type aliases without a docstring of their own.
    (r'py:class', r'torchgpipe\..*\.(T|R)'),  # TypeVars
    (r'py:.*', r'torchgpipe\.(microbatch\.(TensorOrTensors|Tensors)|validation\.Devices?|'
               r'checkpoint\.(Function|Recomputed)|replay\.FirstPass|rng\.RNGStates|'
               r'autocast\.AutocastStates|worker\.(ExcInfo|Result)|train\.step\.LossFunction)'),
]

# -- HTML output -------------------------------------------------------------

html_theme = 'furo'
html_title = f'torchgpipe {release}'
html_static_path = ['_static']
# Wraps the long error messages of the troubleshooting page.
html_css_files = ['messages.css']


# -- Docstrings as a reader sees them -------------------------------------------

class _UnlinkPlainWords(SphinxPostTransform):
    """Leaves the plain English words of docstring types unlinked.

    Napoleon turns ``devices (iterable of devices)`` into a ``:type:`` field,
    and the Python domain makes every word of a type a cross-reference that
    is resolved by suffix (``refspecific``), falling back from classes to
    attributes "for type aliases". So "devices" linked to ``GPipe.devices``
    and "tensors" to the internal ``Batch.tensors``, and ``nitpicky`` cannot
    tell, since the references resolve. In a type, a lowercase word without a
    dot is English ("iterable", "ints", "devices") unless it names a class of
    torchgpipe (``stash``, ``pop``): only those keep their link. The others
    are shown as an unresolved reference would be.
    """

    default_priority = 5  # before ReferencesResolver (10)

    def run(self, **kwargs: Any) -> None:
        domain: Any = self.env.domains['py']
        for node in list(self.document.findall(addnodes.pending_xref)):
            target = node.get('reftarget', '')
            if not (node.get('refdomain') == 'py' and node.get('reftype') == 'class'
                    and node.get('refspecific') and target.isidentifier()
                    and target.islower()):
                continue
            classes = domain.find_obj(self.env, node.get('py:module'), node.get('py:class'),
                                      target, 'class', searchmode=1)
            if not classes:
                node.replace_self(node.children)


def _highlight_docstring_blocks(app: Sphinx, doctree: nodes.document) -> None:
    """Gives the ``::`` blocks of docstrings the language of their content.

    A docstring cannot use ``.. code-block::`` and still read well in
    ``help()``, and its ``Example::`` blocks are Python while its diagrams and
    sample messages are not. A ``>>>`` session is highlighted as one, code
    that parses as Python as Python, anything else as text.
    """
    for block in doctree.findall(nodes.literal_block):
        if 'language' in block or ':docstring of ' not in (block.source or ''):
            continue
        text = block.astext()
        if text.startswith('>>>'):
            block['language'] = 'pycon'
            continue
        try:
            ast.parse(text)
        except SyntaxError:
            block['language'] = 'text'
        else:
            block['language'] = 'python'


def _math_as_code(name: str, rawtext: str, text: str, lineno: int, inliner: Inliner,
                  options: Optional[Dict[str, Any]] = None, content: Sequence[str] = (),
                  ) -> Tuple[List[nodes.Node], List[nodes.system_message]]:
    """``:math:`(N, C, *)``` shown as code.

    The HTML builder renders math with MathJax, a script loaded from the
    internet: offline, a reader would see ``\\(C\\)``. The few formulas of the
    docstrings are shapes and names, which read as well as code.
    """
    return [nodes.literal(rawtext, text)], []


def setup(app: Sphinx) -> None:
    app.add_post_transform(_UnlinkPlainWords)
    app.connect('doctree-read', _highlight_docstring_blocks)
    app.add_role('math', _math_as_code, override=True)


# -- Diagrams ----------------------------------------------------------------

def _draw_diagrams() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return  # The committed SVGs are used as they are.
    runpy.run_path(os.path.join(DOCS, 'diagrams.py'), run_name='__main__')


_draw_diagrams()
