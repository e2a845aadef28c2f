"""What tools need to start ranks: the rank spawner (spawn.py) and the one-minute self-check (selftest.py)."""
