"""jpaged: PagedAttention (Kwon et al., SOSP'23) in JAX — paged KV cache, Pallas kernels, serving engine."""
