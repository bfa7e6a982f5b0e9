"""Pallas kernels that read keys and values through block tables, each beside its plain-jnp reference.

This package imports nothing from jpaged: kernels are pure functions of arrays. Every attention
function and `write_kv` takes one layer's pool `[Hkv, N, Bs, D]`, or the layer-stacked pool
`[L, Hkv, N, Bs, D]` plus a (traced) layer index, which it reads and writes in place.

- paged_attention: decode (one query token per sequence), GQA, split-K. `paged_attention` (Pallas),
  `paged_attention_reference` (plain gather + softmax, the oracle), `paged_attention_xla` (chunk-
  streamed XLA path used on CPU), `select_impl(backend)`.
- paged_prefill: ragged query chunks, causal with the cached-context offset (prompts, prefix-cache
  hits, chunked prefill, recompute, mixed prefill + decode batches). `paged_prefill_attention`,
  `paged_prefill_attention_reference`, `paged_prefill_attention_xla`, `select_impl(backend)`.
- native_cpu (+ native/paged_attention_cpu.cc): the `cpu_native` backend, a C++ XLA FFI kernel for
  decode and prefill attention on CPU that reads the pages in place (compiled on first use);
  `paged_attention_cpu`, `paged_prefill_attention_cpu`, `available()`.
- cache_ops: `write_kv`, `copy_blocks`, `gather_blocks`, `scatter_blocks`; in place via donation.
- contiguous_attention: the non-paged baseline of experiments/kernel_bench/__init__.py.
- backend_names (no jax) and backends: the one registry of backend names (`xla`, `cpu_native`, `pallas_triton`, alias `pallas`,
  `auto`).
- targets: GPU limits (A100 sm_80, H100 sm_90, ...), the target a trace is for, `abstract_gpu`.
- launch: launch shapes chosen per call (splits, warps) and knobs checked against the target.
- triton_compile: Triton IR -> cubin with the `triton` package, without a GPU (tests, tables).
- common: the attention functions' argument checks, Triton shape rules, query-row positions, the
  shared online-softmax step, split-K partials.
"""
