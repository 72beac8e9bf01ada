"""The loop around the model: precision, accumulation, prepared loaders, saving through a strategy."""
