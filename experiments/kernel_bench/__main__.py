from experiments.kernel_bench import main

main()
