from experiments.parallel_sampling import main

main()
