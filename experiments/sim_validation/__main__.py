from experiments.sim_validation import main

main()
