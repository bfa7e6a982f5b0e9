from experiments.preemption import main

main()
