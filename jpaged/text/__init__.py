"""Text in, text out: tokenizer, chat templates, incremental detokenization, stop strings, and the
output processor that turns the engine's token outputs into text outputs."""
