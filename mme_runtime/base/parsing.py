"""How the text of one setting becomes its value: each parser takes the variable's name and its
text, and raises ``ConfigError`` naming both when the text does not parse; ``Setting`` ties a
variable to its parser (``settings.py`` lists them). Never imports torch."""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from mme_runtime.base.errors import ConfigError

Parser = Callable[[str, str], object]

MIB = 1024 * 1024
# MMS 1.1.11 refuses ports at or above 32767 ("Invalid port number").
MAX_MMS_PORT = 32766
# Bounds of the batching settings, wherever they come from (environment, serving.properties).
MAX_BATCH_SIZE = 1024
MAX_BATCH_DELAY_MS = 60_000
MAX_CONCURRENCY = 256
# Bound of a generation's cap on new tokens (environment, serving.properties): a sanity limit, not a
# default.
MAX_NEW_TOKENS = 1_000_000
# CloudWatch's rule for a namespace; "AWS/" starts only AWS's own.
NAMESPACE_PATTERN = re.compile(r"[A-Za-z0-9._/#:-]{1,255}")


@dataclass(frozen=True)
class Setting:
    """One variable. Undocumented ones (no description) are read but left out of the docs."""

    name: str
    field: str
    parse: Parser
    default: str = ""
    description: str = ""


def parse_bool(name: str, value: str) -> bool:
    lowered = value.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise ConfigError(f"{name}={value!r} is not a boolean (use true or false)")


def parse_int(name: str, value: str, minimum: int, maximum: int | None = None) -> int:
    try:
        number = int(value.strip())
    except ValueError as exc:
        raise ConfigError(f"{name}={value!r} is not an integer") from exc
    if number < minimum or (maximum is not None and number > maximum):
        upper = f" and at most {maximum}" if maximum is not None else ""
        raise ConfigError(f"{name}={value!r} must be at least {minimum}{upper}")
    return number


def integer(minimum: int, maximum: int | None = None) -> Parser:
    """A parser of integers within bounds."""
    return lambda name, value: parse_int(name, value, minimum, maximum)


def megabytes(name: str, value: str) -> int:
    return parse_int(name, value, 1) * MIB


def text(name: str, value: str) -> str:
    return value.strip()


def path(name: str, value: str) -> Path:
    return Path(value).absolute()


def namespace(name: str, value: str) -> str:
    """A CloudWatch namespace."""
    stripped = value.strip()
    if not NAMESPACE_PATTERN.fullmatch(stripped) or stripped.startswith("AWS/"):
        raise ConfigError(
            f"{name}={value!r} is not a CloudWatch namespace (up to 255 of A-Z a-z 0-9 . _ / # : -)"
        )
    return stripped


def parse_port(name: str, value: str) -> int:
    try:
        return parse_int(name, value, 1, MAX_MMS_PORT)
    except ConfigError as exc:
        raise ConfigError(f"{exc} (MMS 1.1.11 cannot listen on port 32767 or above)") from exc


def parse_seconds(name: str, value: str) -> float:
    try:
        return float(value)
    except ValueError as exc:
        raise ConfigError(f"{name}={value!r} is not a number of seconds") from exc


def parse_log_level(name: str, value: str) -> int:
    stripped = value.strip()
    if stripped.isdigit():
        return int(stripped)
    level = logging.getLevelName(stripped.upper())
    if not isinstance(level, int):
        raise ConfigError(
            f"{name}={value!r} is not a log level (DEBUG, INFO, WARNING, ERROR or a number)"
        )
    return level


def parse_load_models(name: str, value: str) -> tuple[tuple[str, str], ...]:
    models = []
    for entry in filter(None, (part.strip() for part in value.split(","))):
        model_name, sep, model_path = entry.partition("=")
        if not sep or not model_name or not model_path:
            raise ConfigError(f"{name}: {entry!r} is not of the form name=/path/to/model")
        models.append((model_name, model_path))
    return tuple(models)


def read_properties(file: Path) -> dict[str, str]:
    """Reads a Java properties file the simple way MMS writes them: ``key=value`` lines, ``#``
    comments."""
    properties: dict[str, str] = {}
    for line in file.read_text(encoding="utf-8").splitlines():
        stripped = line.strip()
        if not stripped or stripped.startswith(("#", "!")):
            continue
        key, sep, value = stripped.partition("=")
        if sep:
            properties[key.strip()] = value.strip()
    return properties
