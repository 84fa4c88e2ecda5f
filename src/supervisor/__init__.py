"""The mlx-supervisor daemon, its client library and its CLI.

This package never imports mlx: the models live in runner processes.
"""

__version__ = "0.1.0"
