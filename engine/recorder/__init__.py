"""The flight recorder (ring.py: what actors record; events.py: what is recorded) and its
deterministic replay (replay.py; `python -m engine.replay DUMP`)."""
