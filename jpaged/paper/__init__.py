"""What the paper's measurements need: the compared systems (systems, baselines/), the cost-model
simulator (sim/), request workloads, the trace runner, serving metrics and the Fig. 2 KV split."""
