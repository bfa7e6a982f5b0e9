from experiments.report.document import main

main()
