"""The old home of automatic balancing, which moved to :mod:`torchgpipe.balance`.

It is kept only so that old imports fail with a message telling where to go.
"""
raise ImportError("torchgpipe_balancing has moved to torchgpipe.balance; use "
                  "'from torchgpipe.balance import balance_by_time, balance_by_size' instead")
