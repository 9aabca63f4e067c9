"""Scripts that `torchrun` starts, one process per rank (notebooks 09 and 10; `labkit.launch.launch`)."""
