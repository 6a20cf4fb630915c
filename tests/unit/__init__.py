"""Fast in-process unit tests: no processes, no torch.distributed."""
