from agora_monitor.cli import main

main()
