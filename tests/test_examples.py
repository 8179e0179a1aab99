"""examples/gpt.py: a GPT written as a usual module, flattened and pipelined, on a few steps."""
import os
import runpy

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_gpt_example_trains_like_the_module_on_both_paths(
        capsys: pytest.CaptureFixture[str]) -> None:
    gpt = runpy.run_path(os.path.join(ROOT, 'examples', 'gpt.py'), run_name='gpt')
    threads = torch.get_num_threads()
    try:
        status = gpt['main'](['--steps', '2', '--batch-size', '8', '--layers', '2',
                              '--width', '16', '--length', '8'])
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    assert status == 0, out
    # Each comparison was made and passed: both paths against the module,
    # and both paths against each other with dropout.
    assert out.count('  OK: ') == 3, out
    assert 'tokens/s' in out, out


def test_transformers_example_matches_the_unwrapped_model(
        capsys: pytest.CaptureFixture[str]) -> None:
    example = runpy.run_path(os.path.join(ROOT, 'examples', 'transformers_lm.py'),
                             run_name='transformers_lm')
    status = example['main'](['--steps', '2', '--layers', '2', '--batch-size', '8',
                              '--length', '16'])
    out = capsys.readouterr().out
    assert status == 0, out
    assert out.count('  OK') == 2, out
