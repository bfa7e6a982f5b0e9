from experiments.spec_sim import main

main()
