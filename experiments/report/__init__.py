"""The report and the runs across figures: results/REPORT.md written from every experiment's JSON,
every experiment run in order, and which figures moved between commits.

    python -m experiments.report                   # rewrite results/REPORT.md (document.py)
    python -m experiments.report.reproduce_all     # run every experiment, then rewrite the report
    python -m experiments.report.figure_moves --config configs/figure_moves.yaml

document.py imports every figure's section (experiments/<name>/report.py); the sections import
only the shared experiments/markdown.py, never this package, so the imports run one way.
"""
