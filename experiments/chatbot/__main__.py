from experiments.chatbot import main

main()
