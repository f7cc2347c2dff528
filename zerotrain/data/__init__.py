"""Image data: decoding, aspect buckets, the latent and text-embedding cache, and the global-epoch sampler."""
