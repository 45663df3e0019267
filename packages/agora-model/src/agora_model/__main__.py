from agora_model.cli import main

main()
