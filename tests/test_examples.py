"""examples/gpt.py: a GPT written as a usual module, flattened and pipelined, on a few steps."""
import os
import runpy
import socket
import subprocess
import sys

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


@pytest.mark.timeout(180)
def test_distributed_pipeline_example_trains_like_the_unwrapped_model_and_resumes(
        tmp_path: 'os.PathLike[str]') -> None:
    """examples/distributed_pipeline.py under torchrun, 2 CPU ranks; then resumed."""
    def torchrun(steps: int) -> str:
        with socket.socket() as sock:
            sock.bind(('127.0.0.1', 0))
            port = sock.getsockname()[1]
        done = subprocess.run(
            [sys.executable, '-m', 'torch.distributed.run', '--nproc_per_node', '2',
             '--master_addr', '127.0.0.1', '--master_port', str(port),
             os.path.join(ROOT, 'examples', 'distributed_pipeline.py'), '--steps', str(steps),
             '--verify', '--checkpoint-dir', str(tmp_path), '--save-every', '2',
             '--batch-size', '16', '--chunks', '4'],
            capture_output=True, text=True, timeout=120, cwd=ROOT)
        assert done.returncode == 0, done.stdout + done.stderr
        return done.stdout
    out = torchrun(3)
    assert 'OK: the losses of 3 steps' in out, out
    out = torchrun(5)  # resumes from the checkpoint of step 2
    assert 'resumed from step 2' in out, out
    assert 'OK: the losses of 3 steps' in out, out
