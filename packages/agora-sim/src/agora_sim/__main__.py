from agora_sim.cli import main

main()
