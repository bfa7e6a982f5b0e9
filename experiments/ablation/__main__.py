from experiments.ablation import main

main()
