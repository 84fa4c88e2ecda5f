"""Memory safety, the supervisor's half: the monitor, the estimate, the measured runtime,
admission, and what the ranks of a group hold."""
