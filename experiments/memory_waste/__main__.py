from experiments.memory_waste import main

main()
