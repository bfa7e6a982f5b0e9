from experiments.chunked_prefill import main

main()
