"""Many images on many cores: forked workers over shards of the samples (`workers`) and a Ray cluster
(`ray_backend`)."""
