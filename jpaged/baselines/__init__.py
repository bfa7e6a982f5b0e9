"""Baselines of the paper's §6.1 behind the engine's memory interface: Orca's contiguous buddy
allocation with its reservation policies (buddy)."""
