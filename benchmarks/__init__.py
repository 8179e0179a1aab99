"""Benchmarks and examples reproducing the experiments of the torchgpipe paper."""
