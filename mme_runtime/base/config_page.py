"""The configuration page, ``docs/configuration.md``, generated from ``settings.py`` so that it cannot drift from the
code: a test compares the page with ``configuration_page()``. Regenerate it with::

    .venv/bin/python -m mme_runtime.base.config_page > docs/configuration.md
"""

from __future__ import annotations

from mme_runtime.base.parsing import Setting
from mme_runtime.base.settings import RETIRED, SECTIONS

INTRODUCTION = """\
# Configuration

Every variable the container reads, with its default. SageMaker's own variables come first; the project's own
start with `MME_`. The container logs its effective configuration once at start. A model's own settings
(`batch_size`, `max_batch_delay`, `max_concurrency`, `isolation`, `compile`) go in its `serving.properties`
(see [batching](batching.md)); where both are set, the model's file wins.

This page is generated from `mme_runtime/base/settings.py`; edit the descriptions there.
"""


def markdown_table(settings: tuple[Setting, ...]) -> str:
    lines = ["| Variable | Default | What it does |", "|---|---|---|"]
    lines += [f"| `{s.name}` | {s.default} | {s.description} |" for s in settings if s.description]
    return "\n".join(lines)


RETIRED_INTRODUCTION = """\
## Retired settings

These chose between process designs that no longer exist: since every model is served by a device host (one per
device, or one of its own), the container refuses to start with one of them set, naming what replaced it. So does
`preload_model_gpu=false` in the MME properties file (`MME_PROPERTIES_FILE`), which the entrypoint writes `true`.
"""


def retired_table() -> str:
    lines = ["| Variable | What replaced it |", "|---|---|"]
    lines += [f"| `{name}` | {replacement[0].upper()}{replacement[1:]}. |" for name, replacement in RETIRED.items()]
    return "\n".join(lines)


def configuration_page() -> str:
    parts = [INTRODUCTION]
    for title, settings in SECTIONS:
        parts.append(f"## {title}\n\n{markdown_table(settings)}\n")
    parts.append(f"{RETIRED_INTRODUCTION}\n{retired_table()}\n")
    return "\n".join(parts)


if __name__ == "__main__":
    print(configuration_page(), end="")
