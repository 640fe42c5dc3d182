"""Spawn mode: the controller plugin buckets distributed tests and runs each bucket in rank processes
it starts itself (``python -m harness.spawn.rank_main``); ``harness.torchrun`` is the other mode."""
