"""The daemon process: its main loop, saved state, paths, logs, and the service files that
start it at login."""
