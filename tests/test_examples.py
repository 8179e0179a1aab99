"""The scripts of examples/: each runs a few steps, says what ran, and ends with one summary line.

The summary line is the last line an example prints: ``OK: ...`` when what
it checks holds (``Done: ...`` for a run that checks nothing), so a reader,
or a script, looks at one line. Every option's help gives its default.
"""
import ast
import os
import re
import runpy
import socket
import subprocess
import sys
from typing import List

import pytest
import torch

from benchmarks import untraced

pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, 'examples')
# A Python warning in an example's output, as .ci/run finds them.
WARNING = re.compile(r':[0-9]+: [A-Za-z]*Warning: ')


def lines(out: str) -> List[str]:
    return [line for line in out.splitlines() if line.strip()]


def test_gpt_example_trains_like_the_module_on_both_paths(
        capsys: pytest.CaptureFixture[str]) -> None:
    gpt = runpy.run_path(os.path.join(EXAMPLES, 'gpt.py'), run_name='gpt')
    threads = torch.get_num_threads()
    try:
        status = gpt['main'](['--steps', '2', '--batch-size', '8', '--layers', '2',
                              '--width', '16', '--length', '8'])
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    assert status == 0, out
    assert lines(out)[0].startswith('A GPT of 2 blocks, flattened by to_sequential'), out
    # Each comparison was made and passed: both paths against the module,
    # and both paths against each other with dropout.
    assert out.count('  OK: ') == 3, out
    assert 'tokens/s' in out, out
    assert lines(out)[-1] == 'OK: GPipe trains the flattened GPT like the module, on both paths'


def test_transformers_example_matches_the_unwrapped_model(
        capsys: pytest.CaptureFixture[str]) -> None:
    # transformers is in the dev extra, not in the demo's (examples).
    pytest.importorskip('transformers')
    example = runpy.run_path(os.path.join(EXAMPLES, 'transformers_lm.py'),
                             run_name='transformers_lm')
    status = example['main'](['--steps', '2', '--layers', '2', '--batch-size', '8',
                              '--length', '16'])
    out = capsys.readouterr().out
    assert status == 0, out
    first = lines(out)[0]
    assert first.startswith('transformers LlamaForCausalLM (2 layers'), out
    assert 'GPipe on 4 CPU devices' in first and 'train_step with 1F1B' in first, out
    assert out.count('  OK') == 2, out
    assert re.fullmatch(r"OK: at each of 2 steps, the pipeline's loss is the unwrapped "
                        r"model's \(rtol=1e-9\); final loss \d+\.\d+", lines(out)[-1]), out


def torchrun(script: str, *args: str, processes: int = 2) -> subprocess.CompletedProcess[str]:
    """``script`` of examples/ under torchrun, 2 (``processes``) CPU ranks on this machine."""
    with socket.socket() as sock:
        sock.bind(('127.0.0.1', 0))
        port = sock.getsockname()[1]
    # Untraced by coverage.py: the library code the examples run is measured
    # in the other tests, and tracing would about double their time.
    with untraced():
        done = subprocess.run(
            [sys.executable, '-m', 'torch.distributed.run', '--nproc_per_node', str(processes),
             '--master_addr', '127.0.0.1', '--master_port', str(port),
             os.path.join(EXAMPLES, script), *args],
            capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    assert not WARNING.search(done.stdout + done.stderr), done.stdout + done.stderr
    return done


@pytest.mark.timeout(240)
def test_distributed_pipeline_example_trains_like_the_unwrapped_model_and_resumes(
        tmp_path: 'os.PathLike[str]') -> None:
    """examples/distributed_pipeline.py under torchrun, 2 CPU ranks; then resumed,
    ``--verify`` training the unwrapped model beside it; both without a warning."""
    def run(steps: int, *args: str) -> List[str]:
        return lines(torchrun('distributed_pipeline.py', '--steps', str(steps), *args,
                              '--checkpoint-dir', str(tmp_path), '--save-every', '2',
                              '--batch-size', '16', '--chunks', '4').stdout)
    def last(out: List[str], start: str) -> str:
        """The last line that starts so (the two ranks print in any order)."""
        return [line for line in out if line.startswith(start)][-1]
    out = run(3, '--generate', '6')  # in float32; checks nothing
    assert out[0].startswith('DistributedGPipe over 2 processes (gloo, on CPU)'), out
    assert last(out, 'Done').startswith('Done: 3 steps of DistributedGPipe over 2 processes'), \
        out
    # The logits are on the last partition's rank.
    assert re.fullmatch(r'rank 1 \(the last partition\): held-out loss \d+\.\d+, accuracy '
                        r'\d+\.\d%', last(out, 'rank')), out
    # Resumed from the checkpoint of step 2 (in float64: the unwrapped model,
    # loaded from every rank's checkpoint, gives the same losses).
    out = run(5, '--verify', '--generate', '6')
    assert 'resumed from step 2' in out, out
    # A language model tied across the ranks learns to count, and continues prompts.
    assert 'generated: 3 4 5 -> 6 7 8 9 10 11' in last(out, 'generated: 3'), out
    assert last(out, 'OK: the language') == ("OK: the language model's 40 losses and "
                                             "generated tokens are the unwrapped model's"), out
    assert re.fullmatch(r"OK: the losses of 3 steps and the evaluation are the unwrapped "
                        r"model's \(3 steps of DistributedGPipe over 2 processes, schedule "
                        r"'1f1b', final loss \d+\.\d+\)", last(out, 'OK')), out


def test_distributed_pipeline_example_takes_every_schedule_and_the_v() -> None:
    """Its options take every built-in schedule, written as users write them,
    and the placement each needs: ``--schedule zbv`` implies ``--placement v``."""
    example = runpy.run_path(os.path.join(EXAMPLES, 'distributed_pipeline.py'),
                             run_name='distributed_pipeline')
    parse = example['parse_args']
    for written, name, placement in [('fill-drain', 'fill_drain', 'loop'),
                                     ('1F1B', '1f1b', 'loop'), ('ZB-H1', 'zb_h1', 'loop'),
                                     ('Interleaved-1F1B', 'interleaved_1f1b', 'loop'),
                                     ('zbv', 'zbv', 'v')]:
        args = parse(['--schedule', written])
        assert (args.schedule, args.placement) == (name, placement)
    assert parse(['--schedule', 'zbv', '--placement', 'v']).placement == 'v'
    for wrong in [['--schedule', '1f1b', '--placement', 'v'],
                  ['--schedule', 'zbv', '--placement', 'loop'], ['--schedule', '1fb1']]:
        with pytest.raises(SystemExit):
            parse(wrong)


@pytest.mark.timeout(240)
@pytest.mark.parametrize('schedule, name, held', [
    ('Interleaved-1F1B', 'interleaved_1f1b', 'rank r holds partitions r and r + 2, a loop'),
    ('zbv', 'zbv', 'rank r holds partitions r and 3 - r, a V')])
def test_distributed_pipeline_example_trains_with_two_partitions_per_rank(
        schedule: str, name: str, held: str) -> None:
    """The schedules of virtual stages, under torchrun on 2 CPU ranks, give
    the unwrapped model's losses (the others run as 1F1B does, one partition
    per rank, and tests/distributed/test_distributed_step.py trains with each)."""
    out = lines(torchrun('distributed_pipeline.py', '--steps', '2', '--verify', '--schedule',
                         schedule, '--batch-size', '16', '--chunks', '4').stdout)
    assert f'balance [1, 1, 1, 3] ({held})' in out[0], out
    assert re.fullmatch(r"OK: the losses of 2 steps and the evaluation are the unwrapped "
                        r"model's \(2 steps of DistributedGPipe over 2 processes, schedule "
                        rf"'{name}', final loss \d+\.\d+\)", out[-1]), out


@pytest.mark.timeout(240)
def test_ddp_example_ends_with_identical_replicas() -> None:
    """examples/ddp_pipeline.py: two replicas of a GPipe under DDP, 2 CPU ranks."""
    out = lines(torchrun('ddp_pipeline.py', '--steps', '2', '--log-interval', '1',
                         '--batch-size', '16').stdout)
    assert any(line.startswith('2 replica(s) x batch 16 = global batch 32') for line in out)
    assert re.fullmatch(r'OK: 2 replica\(s\) of a 2-partition GPipe pipeline trained 2 steps '
                        r'under DistributedDataParallel and their parameters are identical; '
                        r'.* samples/s over all replicas', out[-1]), out


@pytest.mark.timeout(240)
def test_sharded_pipeline_example_trains_like_the_unwrapped_model_and_resumes(
        tmp_path: 'os.PathLike[str]') -> None:
    """examples/sharded_pipeline.py under torchrun, 4 CPU ranks (pp 2 x dp 2): built on the
    meta device, each rank holding a quarter of the model; resumed from its DCP checkpoint,
    ``--verify`` training the unwrapped model beside it."""
    def run(*args: str) -> List[str]:
        return lines(torchrun('sharded_pipeline.py', '--checkpoint-dir', str(tmp_path),
                              '--verify', *args, processes=4).stdout)
    out = run('--steps', '2')
    held = [line for line in out if line.startswith('rank ')]
    assert len(held) == 4 and all(line.endswith('parameters (25%)') for line in held), out
    assert [line.split(':')[0] for line in out if line.startswith('step')] == \
        ['step 1', 'step 2'], out
    assert 'saved after step 2' in ' '.join(out), out
    out = run('--steps', '1', '--resume')
    assert [line.split(':')[0] for line in out if line.startswith('step')] == ['step 3'], out
    assert re.fullmatch(r"OK: the losses are the unwrapped model's \(1 steps from step 2 of "
                        r"DistributedGPipe x FSDP2 on pp 2 x dp 2, built on the meta device, "
                        r"schedule '1f1b', final loss \d+\.\d+\)", out[-1]), out


@pytest.mark.parametrize('name', sorted(n for n in os.listdir(EXAMPLES) if n.endswith('.py')))
def test_every_option_says_its_default(name: str) -> None:
    """Every example's parser shows defaults (ArgumentDefaultsHelpFormatter),
    and every option has a help text for it to follow."""
    with open(os.path.join(EXAMPLES, name), encoding='utf-8') as f:
        tree = ast.parse(f.read())
    parsers = options = 0
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        keywords = {k.arg: k.value for k in node.keywords}
        if node.func.attr == 'ArgumentParser':
            parsers += 1
            formatter = keywords.get('formatter_class')
            assert isinstance(formatter, ast.Attribute), name
            assert formatter.attr == 'ArgumentDefaultsHelpFormatter', name
        elif node.func.attr == 'add_argument':
            options += 1
            assert 'help' in keywords, (name, ast.unparse(node))
            assert '(default' not in ast.unparse(keywords['help']), (name, ast.unparse(node))
    assert parsers == 1 and options >= 4, name
