"""The models shipped in assets/, trained here on CPU: the tiny copy-task model (its task:
tiny_task) and the small language model on the Python standard library (its corpus, tokenizer,
model and evaluation).

    python -m experiments.lm.train_tiny --config configs/train_tiny.yaml
    python -m experiments.lm.train_lm --config configs/train_lm.yaml
"""
