"""A whole Agora run on one machine, every node its own process: the main job's local swarm."""
