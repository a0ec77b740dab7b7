"""Small shared helpers: divisibility checks, ceil division, rank-0 logging."""
from __future__ import annotations

import logging
import os

_LOGGER_NAME = "cpinfer"


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def check_divisible(value: int, divisor: int, what: str, by_what: str) -> int:
    """Return value // divisor, or raise ValueError naming both quantities (no silent rounding)."""
    if divisor <= 0:
        raise ValueError(f"{by_what} must be positive, got {divisor}")
    if value % divisor:
        raise ValueError(f"{what} ({value}) must be divisible by {by_what} ({divisor})")
    return value // divisor


def check_positive(value: int, what: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{what} must be a positive integer, got {value!r}")
    return value


def get_logger() -> logging.Logger:
    """The package logger. Only rank 0 logs at INFO by default; other ranks log warnings and errors."""
    logger = logging.getLogger(_LOGGER_NAME)
    if not logger.handlers:
        handler = logging.StreamHandler()
        rank = os.environ.get("RANK", "0")
        handler.setFormatter(logging.Formatter(f"[cpinfer r{rank}] %(levelname)s %(message)s"))
        logger.addHandler(handler)
        level = os.environ.get("CPINFER_LOG", "INFO" if rank == "0" else "WARNING")
        logger.setLevel(level.upper())
        logger.propagate = False
    return logger
