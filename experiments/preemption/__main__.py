"""`python -m experiments.preemption`: the experiment's command line (experiments.common.main with its
config class and run), as the flat module's `__main__` block ran it."""

import logging

from experiments import preemption

logging.basicConfig(level=logging.INFO)
preemption.main(preemption.__doc__.splitlines()[0], preemption.PreemptionConfig, preemption.run,
                "configs/preemption.yaml")
