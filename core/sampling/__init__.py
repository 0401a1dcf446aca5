"""Sampling parameters and the pipeline that runs sampler plugins over a batch."""
