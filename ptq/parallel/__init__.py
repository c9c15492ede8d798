"""Many images on many cores: forked workers over shards of the samples (`workers`) and a Ray cluster
(`ray_backend`), one of them picked by `runners.make_runner`."""
