from experiments.fleet import main

main()
