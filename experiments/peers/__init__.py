"""jpaged against other systems on the same machine and workload, in interleaved fresh-process runs:
nano-vllm's scheduler (host overhead), vLLM's CPU build offline and behind its OpenAI server.

    python -m experiments.peers.<name> --config configs/<name>.yaml

bench_host_peer, cpu_vs_vllm (its vLLM side, cpu_peer_vllm.py, runs in vLLM's own environment),
serve_vs_vllm. They reuse experiments/bench's engines, workloads and serving helpers.
"""
