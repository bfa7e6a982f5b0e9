"""The report and the runs across figures: results/REPORT.md written from every experiment's JSON,
every experiment run in order, and which figures moved between commits.

    python -m experiments.report                   # rewrite results/REPORT.md (document.py)
    python -m experiments.report.reproduce_all     # run every experiment, then rewrite the report
    python -m experiments.report.figure_moves --config configs/figure_moves.yaml

Nothing is imported here, so a figure's section (experiments/<name>/report.py) can import
markdown.py's helpers while document.py imports the sections.
"""
