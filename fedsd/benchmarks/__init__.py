"""`fedsd bench`: timings, the soak under faults, and the distillation term's share of the clipped gradient."""
