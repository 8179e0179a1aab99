"""Runs every code example of the documentation, so that it cannot rot.

What runs, each example as its own test case:

* ``README.md``: every fenced block opened with ```` ```python ````. Blocks in
  other languages (```` ```bash ````) are not run.
* ``docs/*.rst``: every ``.. code-block:: python`` directive, unless it has
  the option ``:class: no-run``, which marks a snippet that needs CUDA or
  stands for part of a program. Literal blocks introduced by ``::`` and
  blocks in other languages (``text``, ``bash``) are illustrations, never run.
* The ``>>>`` examples of the docstrings of every module of torchgpipe, with
  :mod:`doctest` (``ELLIPSIS`` and ``NORMALIZE_WHITESPACE`` on). Their
  globals are the module's own, plus ``torch``, ``nn``, ``F`` and ``GPipe``.
  A line that needs CUDA takes a ``# doctest: +SKIP`` directive.

A README or ``.rst`` example runs as a script of its own, in a fresh
namespace: write it self-contained, with CPU devices, and check what it
claims with ``assert``. A failure points at the file and line of the block.

Also checked: every figure the pages show exists, and every error message
the library raises is explained in ``docs/troubleshooting.rst``.
"""
import ast
import doctest
import importlib
import io
import os
import pkgutil
import re
import textwrap
from typing import Iterator, List, NamedTuple

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import torchgpipe
from torchgpipe import GPipe

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = os.path.join(ROOT, 'docs')


class Example(NamedTuple):
    path: str    # relative to the repository root
    line: int    # 1-based line of the first line of code
    source: str

    @property
    def id(self) -> str:
        return f'{self.path}:{self.line}'


def read(path: str) -> str:
    with open(os.path.join(ROOT, path), encoding='utf-8') as f:
        return f.read()


def doc_pages() -> List[str]:
    return sorted(os.path.join('docs', name) for name in os.listdir(DOCS)
                  if name.endswith('.rst'))


def markdown_examples(path: str) -> Iterator[Example]:
    """The ```python fenced blocks of a Markdown file."""
    text = read(path)
    for match in re.finditer(r'^```python[ \t]*\n(.*?)^```', text, re.M | re.S):
        line = text.count('\n', 0, match.start(1)) + 1
        yield Example(path, line, match.group(1))


CODE_BLOCK = re.compile(r'^(\s*)\.\. code-block::\s*python\s*$')


def rst_examples(path: str, *, runnable: bool = True) -> Iterator[Example]:
    """The ``.. code-block:: python`` blocks of a page, runnable or not."""
    lines = read(path).splitlines()
    i = 0
    while i < len(lines):
        match = CODE_BLOCK.match(lines[i])
        i += 1
        if not match:
            continue
        indent = len(match.group(1))

        def inside(line: str) -> bool:
            return not line.strip() or len(line) - len(line.lstrip()) > indent

        # Options (":class: no-run") come first, up to a blank line.
        options = []
        while i < len(lines) and lines[i].strip().startswith(':') and inside(lines[i]):
            options.append(lines[i].strip())
            i += 1
        start = i
        while i < len(lines) and inside(lines[i]):
            i += 1
        body = lines[start:i]
        # Leading blank lines do not count; the code starts after them.
        while body and not body[0].strip():
            body.pop(0)
            start += 1
        no_run = any(re.fullmatch(r':class:.*\bno-run\b.*', option) for option in options)
        if no_run != runnable:
            yield Example(path, start + 1, textwrap.dedent('\n'.join(body)) + '\n')


README_EXAMPLES = list(markdown_examples('README.md'))
RST_EXAMPLES = [e for page in doc_pages() for e in rst_examples(page)]


def run_example(example: Example) -> None:
    # Padding keeps the line numbers of tracebacks those of the file.
    source = '\n' * (example.line - 1) + example.source
    code = compile(source, os.path.join(ROOT, example.path), 'exec')
    exec(code, {'__name__': '__doc_example__'})


@pytest.mark.parametrize('example', README_EXAMPLES, ids=lambda e: e.id)
def test_readme_example(example: Example) -> None:
    run_example(example)


@pytest.mark.parametrize('example', RST_EXAMPLES, ids=lambda e: e.id)
def test_docs_example(example: Example) -> None:
    run_example(example)


def test_examples_are_found() -> None:
    # Guards the extraction itself: a parser that finds nothing passes.
    assert README_EXAMPLES
    assert len(RST_EXAMPLES) >= 15
    for page in doc_pages():
        text = read(page)
        declared = len(re.findall(r'^\s*\.\. code-block::\s*python\s*$', text, re.M))
        found = len(list(rst_examples(page))) + len(list(rst_examples(page, runnable=False)))
        assert found == declared, page
        for example in rst_examples(page):
            assert example.source.strip(), example.id


# -- docstrings ----------------------------------------------------------------

def package_modules() -> List[str]:
    names = ['torchgpipe']
    for info in pkgutil.walk_packages(torchgpipe.__path__, 'torchgpipe.'):
        names.append(info.name)
    return sorted(names)


def docstring_tests() -> List[doctest.DocTest]:
    finder = doctest.DocTestFinder(exclude_empty=True)
    extraglobs = {'torch': torch, 'nn': nn, 'F': F, 'GPipe': GPipe}
    tests = []
    for name in package_modules():
        module = importlib.import_module(name)
        tests.extend(t for t in finder.find(module, name, extraglobs=extraglobs) if t.examples)
    return sorted(tests, key=lambda t: t.name)


DOCSTRING_TESTS = docstring_tests()


@pytest.mark.parametrize('test', DOCSTRING_TESTS, ids=lambda t: t.name)
def test_docstring_example(test: doctest.DocTest) -> None:
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    report = io.StringIO()
    try:
        result = runner.run(test, out=report.write)
    finally:
        test.globs.clear()
    assert result.failed == 0, report.getvalue()


def test_docstring_examples_are_found() -> None:
    names = {t.name for t in DOCSTRING_TESTS}
    assert 'torchgpipe.gpipe.GPipe' in names
    assert 'torchgpipe.pipeline.clock_cycles' in names


# -- figures and error messages ------------------------------------------------

def test_figures_exist() -> None:
    for page in doc_pages():
        for match in re.finditer(r'^\s*\.\. (?:figure|image)::\s*(\S+)', read(page), re.M):
            path = os.path.join(DOCS, match.group(1))
            assert os.path.isfile(path), f'{page}: {match.group(1)} is missing'


def message_fragments() -> Iterator[str]:
    """The most telling fixed part of every error message of the library.

    Collected from the first argument of every call to an exception class
    (``...Error(...)``, ``...Exception(...)``), from the fix given to
    ``describe(requirement, received, fix)``, and from the lines
    :func:`torchgpipe.skip.verify_skippables` assembles into ``msg``. In an
    f-string, the longest literal piece between substitutions is taken.
    """
    paths = [os.path.join('torchgpipe_balancing.py')]
    for folder, _, files in os.walk(os.path.join(ROOT, 'torchgpipe')):
        paths.extend(os.path.relpath(os.path.join(folder, f), ROOT)
                     for f in files if f.endswith('.py'))

    def pieces(node: ast.expr) -> List[str]:
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return [node.value]
        if isinstance(node, ast.JoinedStr):
            return [v.value for v in node.values
                    if isinstance(v, ast.Constant) and isinstance(v.value, str)]
        if isinstance(node, ast.BinOp):  # 'message %s' % values
            return [p for text in pieces(node.left)
                    for p in re.split(r'%[-#0 +]*[0-9.]*[a-z%]', text)]
        if isinstance(node, ast.Call) and node.args:  # recommend_auto_balance('...')
            return pieces(node.args[0])
        return []

    for path in sorted(paths):
        tree = ast.parse(read(path))
        for node in ast.walk(tree):
            messages = []
            if isinstance(node, ast.Call) and node.args:
                func = node.func
                name = func.id if isinstance(func, ast.Name) else getattr(func, 'attr', '')
                if name.endswith(('Error', 'Exception')):
                    messages.append(node.args[0])
                elif name == 'describe' and len(node.args) == 3:
                    # torchgpipe._validation.describe(requirement, received, fix):
                    # the fix must be on the page too.
                    messages.append(node.args[2])
            elif isinstance(node, ast.Assign) and any(
                    isinstance(t, ast.Name) and t.id == 'msg' for t in node.targets):
                messages.append(node.value)
            for message in messages:
                texts = [' '.join(p.split()).strip(' \'"') for p in pieces(message)]
                texts = [t for t in texts if len(t) >= 8]
                if texts:
                    yield max(texts, key=len)


def test_troubleshooting_lists_every_error_message() -> None:
    page = ' '.join(read(os.path.join('docs', 'troubleshooting.rst')).split())
    fragments = sorted(set(message_fragments()))
    assert len(fragments) >= 40
    missing = [f for f in fragments if f not in page]
    assert not missing, f'explain these error messages in docs/troubleshooting.rst: {missing}'


@pytest.mark.timeout(300)
def test_sphinx_build_has_no_warnings(tmp_path: 'os.PathLike[str]') -> None:
    """The documentation builds with warnings as errors and nitpicky references."""
    import subprocess
    import sys

    result = subprocess.run(
        [sys.executable, '-m', 'sphinx', '-W', '--keep-going', '-n', '-q', '-b', 'html',
         DOCS, os.path.join(str(tmp_path), 'html')],
        capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert 'WARNING' not in result.stderr, result.stderr
