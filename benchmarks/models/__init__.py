"""Models of the paper's experiments, written as flat nn.Sequential modules for GPipe."""
