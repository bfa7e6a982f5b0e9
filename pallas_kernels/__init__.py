"""Pallas kernels that read keys and values through block tables, each beside its plain-jnp reference.

This package imports nothing from jpaged: kernels are pure functions of arrays. Every attention
function and `write_kv` takes one layer's pool `[Hkv, N, Bs, D]`, or the layer-stacked pool
`[L, Hkv, N, Bs, D]` plus a (traced) layer index, which it reads and writes in place.

- paged_attention: decode (one query token per sequence), GQA, split-K. `paged_attention` (Pallas),
  `paged_attention_reference` (plain gather + softmax, the oracle), `paged_attention_xla` (chunk-
  streamed XLA path used on CPU), `select_impl(backend)`.
- paged_prefill: ragged query chunks, causal with the cached-context offset (prompts, prefix-cache
  hits, chunked prefill, recompute). `paged_prefill_attention`, `paged_prefill_attention_reference`
  (also the XLA path), `select_impl(backend)`.
- cache_ops: `write_kv`, `copy_blocks`, `gather_blocks`, `scatter_blocks`; in place via donation.
- contiguous_attention: the non-paged baseline of experiments/kernel_bench.py.
- common: Triton compiler params and shape rules, the shared online-softmax step.
"""
