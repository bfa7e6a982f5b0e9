from experiments.shared_prefix import main

main()
