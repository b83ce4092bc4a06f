"""Logging set-up, called by entrypoints only (never at import). Everything goes to stdout."""

from __future__ import annotations

import logging
import sys

# MMS relays backend lines with its own timestamp and worker name, so backend lines carry only what
# it lacks.
BACKEND_FORMAT = "%(levelname)s [%(name)s] pid=%(process)d %(message)s"
ENTRYPOINT_FORMAT = "%(asctime)s %(levelname)s [%(name)s] %(message)s"
# The frontend routes lines that start with "[METRICS]" to its metrics log: MMS's service logs them
# bare.
RAW_LOGGERS = ("mms.service",)


def configure_logging(level: int, fmt: str = BACKEND_FORMAT) -> None:
    """Replaces the root handlers with one stdout handler, so a forked child never logs twice."""
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter(fmt))
    root = logging.getLogger()
    for existing in list(root.handlers):
        root.removeHandler(existing)
    root.addHandler(handler)
    root.setLevel(level)
    raw = logging.StreamHandler(sys.stdout)
    raw.setFormatter(logging.Formatter("%(message)s"))
    for name in RAW_LOGGERS:
        logger = logging.getLogger(name)
        logger.handlers[:] = [raw]
        logger.propagate = False
