"""``python -m benchmarks [--smoke]``: every CPU preset, as :mod:`benchmarks.run_all`."""
import sys

from benchmarks.run_all import main

if __name__ == '__main__':
    main(sys.argv[1:])
