"""The runner's runtime, measured: what a runner holds before any model.

Every runner pays for Python with mlx and mlx_lm imported (and, on Metal or CUDA, MLX's device
context) before its weights. That differs by machine and backend, so admission plans it from a
measurement rather than a constant: the warm hot spare (a runner with mlx imported and no
model, measured whenever admission runs), or before any spare was measured, a runner's
footprint as soon as it has imported mlx. Until either, the estimator's
:data:`~supervisor.memory.estimate.RUNTIME_DEFAULT_BYTES`, and the estimate says so.
"""

from __future__ import annotations

from typing import Literal

import structlog

from supervisor.memory.estimate import RUNTIME_DEFAULT_BYTES, Estimate, with_runtime

log = structlog.get_logger("supervisor.memory")

Source = Literal["spare", "runner", "default"]


class RuntimeBaseline:
    """The latest measured runtime footprint, and where it came from.

    A spare's reading replaces any earlier one (the latest warm spare is the truth for this
    daemon's code and backend, measured idle); a runner's, as it read itself at its start, is
    taken only while no spare has been read.

    Args:
        default_bytes: the figure before anything is measured.
    """

    def __init__(self, default_bytes: int = RUNTIME_DEFAULT_BYTES) -> None:
        self.runtime_bytes = default_bytes
        self.source: Source = "default"

    @property
    def measured(self) -> bool:
        """Whether the figure is a measurement (a spare's or a runner's)."""
        return self.source != "default"

    def observe(self, footprint_bytes: int, source: Literal["spare", "runner"]) -> None:
        """A runner with mlx imported and no model held ``footprint_bytes`` (RSS, or MLX's own
        figures where larger); ``source`` says which kind of runner. 0 (not read) is ignored."""
        if footprint_bytes <= 0 or (source == "runner" and self.source == "spare"):
            return
        if (footprint_bytes, source) != (self.runtime_bytes, self.source):
            log.info("runtime_measured", runtime_bytes=footprint_bytes, source=source,
                     previous_bytes=self.runtime_bytes, previous_source=self.source)  # fmt: skip
        self.runtime_bytes, self.source = footprint_bytes, source

    def apply(self, estimate: Estimate) -> Estimate:
        """``estimate`` (of one runner) with this runtime in place of the one it carries."""
        return with_runtime(estimate, self.runtime_bytes, self.source)
