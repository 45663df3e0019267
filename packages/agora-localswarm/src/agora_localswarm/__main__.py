from agora_localswarm.cli import main

main()
