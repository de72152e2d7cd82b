"""Reading checkpoints: weight files, shards and their checks (generic); a family normalises names."""
