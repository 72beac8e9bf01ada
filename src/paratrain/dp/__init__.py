"""The DataParallel pipeline in one process: scatter, replicate, parallel_apply, gather (torch.nn.parallel's)."""
