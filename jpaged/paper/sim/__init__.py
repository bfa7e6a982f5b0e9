"""The simulator's pieces: GPU datasheets (gpus), the roofline step-cost model (cost_model) over the
per-layer work (shapes) with its constants fitted offline (fit_vidur, measured) or a profiled fit
(profiled), the simulated executor (executor) and its configuration (config: SimConfig), and
speculative decoding's verify step and throughput priced on the cost model (speculative)."""
