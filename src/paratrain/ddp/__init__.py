"""DistributedDataParallel: the wrapper, its start-up, buckets, the reducer, communication hooks, join."""
