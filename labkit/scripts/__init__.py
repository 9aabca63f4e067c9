"""Scripts that `torchrun` starts, one process per rank (notebook 09; `labkit.parallel.launch`)."""
