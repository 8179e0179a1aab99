"""Runs every code example of the documentation, so that it cannot rot.

What runs, each example as its own test case:

* ``README.md``: every fenced block opened with ```` ```python ````. Blocks in
  other languages (```` ```bash ````) are not run here: ``.ci/run`` runs the
  README's two set-up commands, each in a fresh venv; its docs build is
  this file's (the fixture ``build``, with the same options), its
  benchmarks' smoke run tests/test_benchmarks_smoke.py's.
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

Also checked: every figure the pages show exists, every error message the
library raises is explained in ``docs/troubleshooting.rst``, the README's
demo passes on a few steps, and the documentation builds without warnings
into pages that show no error box, link the words of parameter types only to
classes, and load nothing from the internet.
"""
import ast
import doctest
import glob
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
from benchmarks import untraced
from torchgpipe import GPipe

pytestmark = pytest.mark.slow

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


def measured_unless_it_captures_a_library_model(example: Example) -> object:
    """An example that captures a model of transformers runs untraced: torch.export's many
    Python calls make coverage.py's tracing cost more than the example itself, and
    the capture's lines are measured by tests/capture/test_models.py and tests/test_capture*.py."""
    if 'import transformers' in example.source:
        return pytest.param(example, marks=pytest.mark.unmeasured)
    return example


@pytest.mark.parametrize('example', [measured_unless_it_captures_a_library_model(e)
                                     for e in RST_EXAMPLES], ids=lambda e: e.id)
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


def test_demo_matches_the_unwrapped_model_on_both_paths(
        capsys: pytest.CaptureFixture[str]) -> None:
    """``examples/demo.py``, the README's first command, on a few steps."""
    import runpy

    demo = runpy.run_path(os.path.join(ROOT, 'examples', 'demo.py'), run_name='demo')
    threads = torch.get_num_threads()
    try:
        status = demo['main'](['--steps', '3', '--batch-size', '16', '--chunks', '4'])
    finally:
        torch.set_num_threads(threads)
    out, err = capsys.readouterr()
    assert status == 0, out
    assert 'GPipe, 1 thread' in out and 'GPipe, 4 threads' in out, out
    said = [line for line in out.splitlines() if line.strip()]
    assert said[0].startswith('A CNN of 11 layers trained three times'), out
    assert said[-1].startswith('OK: on both paths'), out  # the summary line comes last
    # Not a terminal here: no bar redrawn into the log, a line per run's end.
    assert '\r' not in out + err and err == '', err
    assert len([line for line in said if ': step 3/3 loss ' in line]) == 3, out

    # A line an epoch: here 4 steps each.
    iterable, report = demo['progress'](list(range(10)), 'run', 4)
    for step in iterable:
        report(step, 0.5)
    assert capsys.readouterr().out.splitlines() == [
        f'run: step {step}/10 loss 0.5000' for step in (4, 8, 10)]


# The documented spelling, run as a user's script would: `import torchgpipe`
# and nothing else of the package before torchgpipe.distributed.train_step.
DOCUMENTED_SPELLING = """
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import torchgpipe

assert 'torchgpipe.distributed' not in sys.modules, 'loaded by import torchgpipe'
with tempfile.NamedTemporaryFile() as store:
    dist.init_process_group('gloo', init_method=f'file://{store.name}', rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
        gpipe = torchgpipe.GPipe(model, balance=[2, 1], devices=['cpu', 'cpu'], chunks=2)
        ddp = DistributedDataParallel(gpipe)
        input, target = torch.randn(6, 4), torch.tensor([0, 1, 2, 0, 1, 2])
        loss = torchgpipe.distributed.train_step(ddp, input, target, F.cross_entropy,
                                                 schedule='1f1b')
        assert torch.allclose(loss, F.cross_entropy(model(input), target))
    finally:
        dist.destroy_process_group()
print('trained through torchgpipe.distributed.train_step')
"""


def test_documented_spelling_of_distributed_train_step_runs_after_import_torchgpipe() -> None:
    """README.md, docs/scaling_out.rst and the error of ``gpipe.train_step``
    under DDP write ``torchgpipe.distributed.train_step(...)``: it works
    after ``import torchgpipe`` alone, in a fresh process, and that import
    does not load the submodule before it is used."""
    import subprocess
    import sys

    for path in ['README.md', os.path.join('docs', 'scaling_out.rst')]:
        assert 'torchgpipe.distributed.train_step(' in read(path), path
    done = subprocess.run([sys.executable, '-c', DOCUMENTED_SPELLING], capture_output=True,
                          text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    assert 'trained through torchgpipe.distributed.train_step' in done.stdout


def test_front_pages_tour_the_tools_beyond_gpipe() -> None:
    """A newcomer reads the index and getting started first: both name each
    tool past the plain GPipe, with a link to the page that explains it."""
    tools = {'to_sequential': 'any_model', 'train_step': 'schedules', 'trace': 'timeline',
             'DistributedGPipe': 'scaling_out'}
    for page in ['index.rst', 'getting_started.rst']:
        text = read(os.path.join('docs', page))
        for name, target in tools.items():
            assert re.search(r':(func|meth|class):`[^`]*\b' + name + '>?`', text), (page, name)
            assert f':doc:`{target}`' in text, (page, target)


def test_readme_features_name_each_tool_with_a_link_to_its_page() -> None:
    """The README's Features list names evaluation, generation, the five
    schedules, tied weights across ranks and DCP, each in a bullet that links
    the page explaining it, which says it too."""
    features = read('README.md').split('\n## Features\n', 1)[1].split('\n## ', 1)[0]
    bullets = re.findall(r'^- (.*)$', features, re.M)
    wanted = {'eval_step': ('schedules', 'eval_step'),
              'torchgpipe.generate': ('scaling_out', 'torchgpipe.generate'),
              "'fill_drain'": ('schedules', "'fill_drain'"), "'1f1b'": ('schedules', "'1f1b'"),
              "'interleaved_1f1b'": ('schedules', "'interleaved_1f1b'"),
              "'zb_h1'": ('schedules', "'zb_h1'"), "'zbv'": ('schedules', "'zbv'"),
              'tied weights across ranks': ('scaling_out', 'Tied weights'),
              'DCP (`torch.distributed.checkpoint`)': ('scaling_out',
                                                       'torch.distributed.checkpoint')}
    for term, (page, said) in wanted.items():
        bullet = next((b for b in bullets if term in b), None)
        assert bullet is not None, f'README.md Features names {term}'
        assert f'](docs/{page}.rst)' in bullet, (term, bullet)
        assert said in read(os.path.join('docs', f'{page}.rst')), (term, page)
    for link in re.findall(r'\]\((docs/[^)]+)\)', features):
        assert os.path.isfile(os.path.join(ROOT, link)), link


def test_the_dcp_example_has_its_imports_and_its_path() -> None:
    """The checkpoint of torch.distributed.checkpoint in docs/scaling_out.rst
    is a runnable example (so test_docs_example runs it): its imports and
    the path it saves to are in it."""
    found = [e for e in rst_examples(os.path.join('docs', 'scaling_out.rst'))
             if 'dcp.save(' in e.source]
    assert len(found) == 1, 'one runnable example saves with dcp.save'
    source = found[0].source
    assert 'import torch.distributed.checkpoint as dcp' in source
    assert 'from torch.distributed.checkpoint.state_dict import' in source
    assert re.search(r'^\s*path = ', source, re.M) and 'dcp.load(' in source


def user_pages() -> List[str]:
    """The pages of the index's table of contents captioned "User documentation"."""
    toc = re.search(r'^\.\. toctree::\n(?:   :.*\n)*?   :caption: User documentation\n'
                    r'(?:   :.*\n)*\n((?:   \S.*\n)+)', read(os.path.join('docs', 'index.rst')),
                    re.M)
    assert toc, 'the user documentation table of contents of docs/index.rst'
    return [os.path.join('docs', name.strip() + '.rst') for name in toc.group(1).splitlines()]


def test_user_pages_leave_maintainer_material_to_internals() -> None:
    """How a fault of PyTorch was found (gdb), stress counts and their
    statistics, and which wheels install together are for maintainers:
    docs/internals.rst holds them. What users need is said plainly, such as
    that the NCCL path is untested."""
    pages = user_pages()
    assert len(pages) >= 8 and os.path.join('docs', 'scaling_out.rst') in pages, pages
    maintainer = ['gdb', "Fisher's exact", 'stress_ddp_exit', "project's machines",
                  'core of an aborted', 'Python Package Index is built']
    for page in pages:
        text = ' '.join(read(page).split())
        assert not [m for m in maintainer if m in text], page
    internals = ' '.join(read(os.path.join('docs', 'internals.rst')).split())
    assert 'gdb' in internals and "Fisher's exact" in internals
    scaling_out = ' '.join(read(os.path.join('docs', 'scaling_out.rst')).split())
    assert 'This path is untested' in scaling_out and 'NCCL is untested' in scaling_out


#: torchgpipe 0.0.7's modules, which its users' scripts import (torchgpipe/__init__.py).
MODULES_OF_0_0_7 = ['__version__', 'batchnorm', 'checkpoint', 'copy', 'dependency', 'gpipe',
                    'microbatch', 'phony', 'pipeline', 'stream', 'worker']


def test_user_pages_name_only_public_paths() -> None:
    """Every ``torchgpipe.`` path a user page names lies in a module the API
    reference documents (or one of 0.0.7's): internal modules are for
    docs/internals.rst and docs/design.rst."""
    from importlib.util import find_spec

    api = read(os.path.join('docs', 'api.rst'))
    public = set(re.findall(r'^\.\. (?:automodule|currentmodule):: (\S+)$', api, re.M))
    public |= {'torchgpipe', *(f'torchgpipe.{name}' for name in MODULES_OF_0_0_7)}
    pages = [p for p in user_pages() if not p.endswith('benchmarks.rst')]
    pages += [os.path.join('docs', f'{name}.rst') for name in ['api', 'differences', 'index']]
    internal = []
    for page in pages:
        for path in set(re.findall(r'\btorchgpipe(?:\.\w+)+', read(page))):
            module = 'torchgpipe'  # then the longest prefix that is a module
            for part in path.split('.')[1:]:
                spec = find_spec(module)
                if not (spec and spec.submodule_search_locations
                        and find_spec(f'{module}.{part}')):
                    break
                module = f'{module}.{part}'
            if module not in public:
                internal.append(f'{page}: {path}')
    assert not internal, internal


def test_the_six_properties_the_tests_cite_are_listed_with_their_tests() -> None:
    """Tests cite "Property 1" to "Property 6" (SPEC's properties of GPipe);
    docs/guide.rst lists all six, each with test files that exist, and every
    test module citing a property is among that property's files."""
    guide = read(os.path.join('docs', 'guide.rst'))
    rows = re.split(r'^   \* - Property ', guide, flags=re.M)[1:]
    assert [row[0] for row in rows] == list('123456')
    listed = {}
    for row in rows:
        row = row.split('\n\n')[0]  # the table ends at the first blank line
        files = re.findall(r'``(tests/[\w/]+\.py)``', row)
        assert files, row
        for path in files:
            assert os.path.isfile(os.path.join(ROOT, path)), path
        listed[row[0]] = set(files)
    for path in sorted(glob.glob(os.path.join(ROOT, 'tests', '**', '*.py'), recursive=True)):
        name = os.path.relpath(path, ROOT)
        if name != os.path.join('tests', 'test_docs.py'):
            with open(path, encoding='utf-8') as f:
                for number in re.findall(r'\bPropert(?:y|ies) ([1-6])\b', f.read()):
                    assert name in listed[number], (name, number)


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
    assert 'torchgpipe.engine.pipeline.clock_cycles' in names


@pytest.mark.timeout(240)
@pytest.mark.unmeasured  # captures a model of transformers, as above
def test_generate_docstring_example_runs_on_a_model_fresh_from_its_constructor() -> None:
    """The example of ``generate``, not a doctest (it needs transformers), runs as
    written on a model in training mode, dropout on, as its constructor made it."""
    transformers = pytest.importorskip('transformers')
    from helpers import literal_block, run_snippet

    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100,
                                     n_positions=64)
    input_ids = torch.randint(0, 100, (4, 5), generator=torch.Generator().manual_seed(0))
    namespace = {'to_sequential': torchgpipe.to_sequential, 'GPipe': GPipe,
                 'generate': torchgpipe.generate, 'config': config, 'input_ids': input_ids,
                 'GPT2LMHeadModel': transformers.GPT2LMHeadModel}
    example = literal_block(torchgpipe.generate.__doc__ or '', 'Example')
    torch.manual_seed(0)
    run_snippet(example, namespace, {'balance': lambda ns: [len(ns['seq']) // 2,
                                                            len(ns['seq']) - len(ns['seq']) // 2]})
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).eval()  # the same weights
    expected = model.generate(input_ids, attention_mask=torch.ones_like(input_ids),
                              do_sample=False, max_new_tokens=20, pad_token_id=0)
    assert torch.equal(namespace['tokens'], expected)
    assert namespace['pipe'].training  # as it was


# -- figures and error messages ------------------------------------------------

def test_figures_exist() -> None:
    for page in doc_pages():
        for match in re.finditer(r'^\s*\.\. (?:figure|image)::\s*(\S+)', read(page), re.M):
            path = os.path.join(DOCS, match.group(1))
            assert os.path.isfile(path), f'{page}: {match.group(1)} is missing'


def message_fragments() -> Iterator[str]:
    """The most telling fixed part of every error message of the library.

    Collected from the first argument of every call to an exception class
    (``...Error(...)``, ``...Exception(...)``, ``Mismatch(...)``), from the fix given to
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
                # Mismatch: torchgpipe.distributed's ValueError of ranks that disagree.
                if name.endswith(('Error', 'Exception')) or name == 'Mismatch':
                    messages.append(node.args[0])
                elif name == 'describe' and len(node.args) == 3:
                    # torchgpipe.foundation.validation.describe(requirement, received, fix):
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


# -- the built documentation -----------------------------------------------------

class Build(NamedTuple):
    returncode: int
    stderr: str
    html: str  # the output directory


#: The options of README.md's docs build, which the fixture below builds with.
SPHINX_OPTIONS = ['-W', '--keep-going', '-n', '-b', 'html']


@pytest.fixture(scope='module')
def build(tmp_path_factory: pytest.TempPathFactory) -> Build:
    """The HTML documentation, built as ``docs/conf.py`` says: warnings are
    errors and every cross-reference must resolve."""
    import subprocess
    import sys

    html = str(tmp_path_factory.mktemp('docs') / 'html')
    # Untraced: Sphinx's import of the package measures nothing new.
    with untraced():
        result = subprocess.run(
            [sys.executable, '-m', 'sphinx', *SPHINX_OPTIONS, '-q', DOCS, html],
            capture_output=True, text=True)
    return Build(result.returncode, result.stderr, html)


def test_the_build_here_is_the_readmes_docs_command() -> None:
    """CI runs README.md's docs build only as this file's fixture: the same options."""
    readme = open(os.path.join(ROOT, 'README.md'), encoding='utf-8').read()
    command, = re.findall(r'python -m sphinx (.*)', readme)
    assert command.split() == [*SPHINX_OPTIONS, 'docs', 'docs/_build/html'], command


def built_pages(build: Build) -> List[str]:
    pages = sorted(name for name in os.listdir(build.html) if name.endswith('.html'))
    assert 'index.html' in pages and 'api.html' in pages, pages
    return pages


@pytest.mark.timeout(300)
def test_sphinx_build_has_no_warnings(build: Build) -> None:
    assert build.returncode == 0, build.stderr
    assert 'WARNING' not in build.stderr, build.stderr


def problems_shown(page: str) -> List[str]:
    """What a reader of a built page would see as an error.

    A warning-free build still shows some: docutils system messages and
    unresolved markup that a lower report level lets through, error
    admonitions, and tables of contents, which Furo paints as a red box
    ("ERROR: Adding a table of contents in Furo-based documentation is
    unnecessary", from its style sheet, so nothing in the HTML says so).
    """
    # The search page's <noscript> error only shows without JavaScript.
    page = re.sub(r'<noscript>.*?</noscript>', '', page, flags=re.S)
    problems = []
    for match in re.finditer(r'<(\w+)[^>]*\bclass="([^"]*)"', page):
        classes = match.group(2).split()
        if 'system-message' in classes or 'problematic' in classes:
            problems.append(f'docutils system message or problematic markup: {match.group(0)}')
        if 'admonition' in classes and 'error' in classes:
            problems.append(f'error admonition: {match.group(0)}')
        if ('contents' in classes
                and 'this-will-duplicate-information-and-it-is-still-useful-here' not in classes):
            problems.append(f'a table of contents, a red error box in Furo: {match.group(0)}')
    return problems


@pytest.mark.timeout(300)
def test_built_pages_show_no_error_boxes(build: Build) -> None:
    assert build.returncode == 0, build.stderr
    found = {}
    for name in built_pages(build):
        with open(os.path.join(build.html, name), encoding='utf-8') as f:
            problems = problems_shown(f.read())
        if problems:
            found[name] = problems
    assert not found, found


def test_problems_shown_finds_what_furo_and_docutils_show() -> None:
    # Guards the check itself, on the markup Sphinx and Furo produce.
    assert problems_shown('<nav class="contents local" id="on-this-page">')
    assert problems_shown('<aside class="system-message"><p>System Message: WARNING/2</p>')
    assert problems_shown('<span class="problematic" id="id1">`oops</span>')
    assert problems_shown('<div class="admonition error"><p>Error</p></div>')
    assert not problems_shown('<noscript><div class="admonition error">JS</div></noscript>')
    assert not problems_shown('<div class="toc-tree-container"><nav class="toc-tree">')
    assert not problems_shown(
        '<nav class="contents this-will-duplicate-information-and-it-is-still-useful-here">')


@pytest.mark.timeout(300)
def test_words_of_parameter_types_link_only_to_classes(build: Build) -> None:
    """A type such as ``devices (iterable of devices)`` links its words to
    the classes they name, never to an attribute that happens to share a
    word ("devices" to ``GPipe.devices``, "tensors" to ``Batch.tensors``)."""
    import posixpath

    from sphinx.util.inventory import InventoryFile

    assert build.returncode == 0, build.stderr
    with open(os.path.join(build.html, 'objects.inv'), 'rb') as f:
        inventory = InventoryFile.load(f, '', posixpath.join)
    classes = set(inventory['py:class']) | set(inventory['py:exception'])
    # Napoleon's parameter types are the links whose text is emphasized.
    type_link = re.compile(r'<a class="reference internal" href="[^"]*" title="([^"]*)">'
                           r'<em>([^<]*)</em></a>')
    wrong = []
    links = 0
    for name in built_pages(build):
        with open(os.path.join(build.html, name), encoding='utf-8') as f:
            for target, word in type_link.findall(f.read()):
                links += 1
                if target not in classes:
                    wrong.append(f'{name}: {word!r} links to {target}')
    assert links, 'no parameter type links found: the pattern is out of date'
    assert not wrong, wrong


@pytest.mark.timeout(300)
def test_built_pages_load_nothing_from_the_internet(build: Build) -> None:
    """The documentation reads offline: no script (MathJax for ``:math:``),
    style sheet, font or image is fetched from elsewhere. Links may point
    anywhere."""
    assert build.returncode == 0, build.stderr
    remote = re.compile(r'<(?:script|img|iframe|source|audio|video|embed)\b[^>]*'
                        r'\bsrc="(?:https?:)?//'
                        r'|<link\b[^>]*\bhref="(?:https?:)?//', re.I)
    found = {}
    for name in built_pages(build):
        with open(os.path.join(build.html, name), encoding='utf-8') as f:
            loads = [m.group(0) for m in remote.finditer(f.read())]
        if loads:
            found[name] = loads
    assert not found, found


@pytest.mark.timeout(300)
def test_troubleshooting_messages_wrap(build: Build) -> None:
    """The long error messages wrap inside their boxes: the page loads the
    style sheet that says so, and its selector matches the page."""
    assert build.returncode == 0, build.stderr
    with open(os.path.join(DOCS, '_static', 'messages.css'), encoding='utf-8') as f:
        css = f.read()
    selector = re.search(r'^(section#(\S+) div\.highlight-text pre) \{[^}]*'
                         r'white-space: pre-wrap;', css, re.M)
    assert selector, css
    with open(os.path.join(build.html, 'troubleshooting.html'), encoding='utf-8') as f:
        page = f.read()
    assert re.search(r'<link [^>]*href="_static/messages\.css[?"]', page)
    assert f'<section id="{selector.group(2)}">' in page
    assert '<div class="highlight-text notranslate">' in page
