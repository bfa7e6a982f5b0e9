"""The simulator's pieces: GPU datasheets (gpus) and the roofline step-cost model (cost_model)."""
