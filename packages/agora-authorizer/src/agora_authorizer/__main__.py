from agora_authorizer.cli import main

main()
