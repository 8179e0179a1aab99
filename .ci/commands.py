"""The set-up commands of README.md that ``.ci/run`` runs: one line each,
``extra<TAB>command<TAB>requirements`` (the extra's requirements in
pyproject.toml, separated by spaces).

A command of README.md installs this repository with one extra (``-e ".[name]"``)
and runs what that extra is for. README.md gives them in its ```` ```bash ````
blocks (one command a line) and in its prose (an inline code span). The
README is their only source.

CI runs the first two, the README's set-up commands (the demo, with the
``examples`` extra, and the test suite, with ``dev``), exactly as written,
each in a fresh virtual environment that holds nothing else, so an extra that
misses a dependency fails CI instead of passing on a machine that happens to
have it. The others (the docs build, the benchmarks' smoke run) are run by the
test suite itself, in the same words (tests/test_docs.py builds the docs with
the same Sphinx options, tests/test_benchmarks_smoke.py runs every
benchmark's smoke preset); tests/test_packaging.py checks that their extras
hold every package they import. Running them again, each in a venv of its
own, cost CI two minutes more for nothing else.

Also checked here, so that no extra goes untested:

* every extra of ``pyproject.toml`` has exactly one command, and every
  command installs exactly one extra, one that it declares;
* every extra that a documentation page or ``docs/conf.py`` names has a
  command;
* every command pins ``torch==2.13.0``, whose CPU build lies on the CI
  machine's disk (unpinned, pip would fetch a multi-gigabyte CUDA build).

Any of these failing prints why and exits with status 1.
"""
import re
import sys
import tomllib
from pathlib import Path
from typing import List, Tuple

ROOT = Path(__file__).resolve().parent.parent
EXTRA = re.compile(r'''\.\[([\w-]+)\]''')
TORCH = 'torch==2.13.0'
#: How many of the commands, from the first, are the README's set-up commands, which CI runs.
SET_UP = 2


def readme_commands(text: str) -> List[str]:
    """Every bash line and inline code span of the README that installs an extra."""
    commands = []
    fenced = re.compile(r'^```(\w*)[ \t]*\n(.*?)^```', re.M | re.S)
    for match in fenced.finditer(text):
        if match.group(1) == 'bash':
            commands += [line.strip() for line in match.group(2).splitlines()]
    prose = fenced.sub('', text)
    # An inline code span may wrap over lines: Markdown reads the break as a space.
    commands += [' '.join(span.split()) for span in re.findall(r'`([^`]+)`', prose)]
    return [c for c in commands if re.search(r'pip install .*-e "' + EXTRA.pattern, c)]


def main() -> int:
    commands: List[Tuple[str, str]] = []
    errors = []
    for command in readme_commands((ROOT / 'README.md').read_text(encoding='utf-8')):
        extras = EXTRA.findall(command)
        if len(extras) != 1:
            errors.append(f'installs {len(extras)} extras, not one: {command}')
            continue
        if TORCH not in command.split():
            errors.append(f'does not pin {TORCH}: {command}')
        commands.append((extras[0], command))

    named = [extra for extra, _ in commands]
    declared = tomllib.loads((ROOT / 'pyproject.toml').read_text(encoding='utf-8'))
    declared_extras = set(declared['project'].get('optional-dependencies', {}))
    for extra in sorted(set(named)):
        if named.count(extra) > 1:
            errors.append(f'more than one set-up command installs the extra {extra!r}')
    for extra in sorted(declared_extras - set(named)):
        errors.append(f'no set-up command installs the extra {extra!r} of pyproject.toml')
    for extra in sorted(set(named) - declared_extras):
        errors.append(f'pyproject.toml has no extra {extra!r}')
    docs = sorted((ROOT / 'docs').glob('*.rst')) + [ROOT / 'docs' / 'conf.py']
    for page in docs:
        for extra in EXTRA.findall(page.read_text(encoding='utf-8')):
            if extra not in named:
                errors.append(f'{page.relative_to(ROOT)} names the extra {extra!r}, '
                              'which no set-up command of README.md installs')

    if errors:
        for error in errors:
            print(f'README.md set-up commands: {error}', file=sys.stderr)
        return 1
    requirements = declared['project']['optional-dependencies']
    for extra, command in commands[:SET_UP]:
        # Without blanks, each a word to the shell (PEP 508 needs none).
        words = [''.join(requirement.split()) for requirement in requirements[extra]]
        print('\t'.join([extra, command, ' '.join(words)]))
    return 0


if __name__ == '__main__':
    sys.exit(main())
