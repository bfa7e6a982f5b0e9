from experiments.block_size import main

main()
