"""Files written whole or not at all (atomic), a state folder walked once and held open
(state_folder), a run's result folder (results) and the on-disk cache (cache)."""
