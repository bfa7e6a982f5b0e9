"""The doors users walk through: `LLM` (offline), the async engine, engine arguments, the `jpaged`
command, the OpenAI-compatible server (serve/) and its benchmark client (bench_serving)."""
