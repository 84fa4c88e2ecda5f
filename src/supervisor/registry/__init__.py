"""The models the daemon knows: their entries and legal moves, supervision and restart, the
request queue and relay, specs and load on demand."""
