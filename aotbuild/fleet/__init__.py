"""Many machines: the build matrix, on this machine or as Ray tasks (`matrix`), and joining or
starting a Ray cluster (`cluster`, which serving uses too)."""
