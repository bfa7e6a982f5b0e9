"""Benchmarks of jpaged itself, on this machine's CPU (or its GPU): host overhead, one decode step,
the native dense kernel, where the forward step's time goes, the real executor beside the cost
model, the real engine against static batching, the HTTP server against offline generation, and
speculative decoding against the same engine without it.

    python -m experiments.bench.<name> --config configs/<name>.yaml

bench_host, bench_decode, dense_bench, profile_forward, profile_executor, serve_real,
serve_vs_offline, sampling_cost, bench_sampler, bench_grammar, bench_overlap, plan_transport,
spec_decode, spec_serve; serve_common.py holds what the serving benchmarks share (a server process and
its CPU time, `jpaged bench-serving` runs), here and in experiments/peers.
"""
