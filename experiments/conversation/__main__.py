from experiments.conversation import main

main()
