"""The runner: the child process that holds one model.

The only package that imports mlx and mlx_lm. Start it as ``python -m runner``.
"""
