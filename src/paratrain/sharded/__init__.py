"""ZeRO: partitions of the parameters, the sharded reducer and optimizer, the wrapper that runs them."""
