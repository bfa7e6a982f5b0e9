from experiments.record_beams import main

main()
