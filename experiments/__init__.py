"""The experiments, grouped by purpose; each parses a YAML config, runs `run(config) -> dict` and
writes its results atomically with their provenance.

- The paper's figures, one package each, `python -m experiments.<name> --config configs/<name>.yaml`:
  throughput, memory_waste, parallel_sampling, shared_prefix, chatbot, kernel_bench, block_size,
  preemption, record_beams, chunked_prefill, sim_validation, spec_sim. A package holds the experiment
  (__init__.py: its config dataclass, run, main), its section of results/REPORT.md (report.py) and
  the plots only it draws (plots.py).
- The rest, `python -m experiments.<group>.<name> --config configs/<name>.yaml`: bench/ (jpaged's own
  benchmarks), peers/ (against other systems), lm/ (training the models in assets/), report/
  (results/REPORT.md, reproduce_all, figure_moves).
- Shared: common.py (command line, provenance, JSON results), serving.py (the figures' sweeps and
  meters), plots.py (the figures' colors and curves), markdown.py (what every REPORT.md section
  shares), paged_batch.py (plans from explicit contexts and block tables, scattered tables, greedy
  generation through the model runner without the engine). The figures and groups import these,
  report/ imports the figures' sections, and nothing outside report/ imports report/.
"""
