"""Runner processes as the daemon holds them: one handle per process (spawn, pipes, pings,
the stall watchdog, the kill ladder), groups of ranks, the warm spare, and what an exit means."""
