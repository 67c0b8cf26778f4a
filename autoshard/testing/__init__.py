"""Test support: run a function on N real ranks, or plan inside a fake one-process world.

See :mod:`autoshard.testing.multirank` and :mod:`autoshard.testing.fake_world`.
"""

from .fake_world import fake_world
from .multirank import RankFailure, RankTimeout, run_on_ranks, shutdown_pools

__all__ = ["run_on_ranks", "RankFailure", "RankTimeout", "shutdown_pools", "fake_world"]
