"""Experiment entry points: python -m experiments.<name> --config configs/<name>.yaml."""
