from experiments.throughput import main

main()
