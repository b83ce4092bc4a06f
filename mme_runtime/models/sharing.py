"""Which models share their device's host and which get a device host of their own, and why: the answer is logged
with the model's LOAD.

A model gets a host of its own when the container turns sharing off (``MME_SHARE_DEVICE=false``), when its handler
is not ours (MMS's ``module:function``), when its ``serving.properties`` says ``isolation=process``, when its
``requirements.txt`` asks for anything the image does not already satisfy (what pip installs for one model must not
change the modules every other model in the host imports), or when its own ``code/`` holds Python modules beside its
script: a host imports them by their plain names (``import utils``), which one interpreter holds once, so another
model's ``utils`` would be taken for its own. ``isolation=shared`` says the names are unique and shares such a model
all the same.
"""

from __future__ import annotations

import logging
from importlib import metadata
from pathlib import Path

from packaging.requirements import InvalidRequirement, Requirement

from mme_runtime.base.config import Config
from mme_runtime.base.errors import ModelLoadError
from mme_runtime.models.code_fetcher import CodeFetcher, locate_code
from mme_runtime.models.dependencies import REQUIREMENTS
from mme_runtime.models.loading import OUR_HANDLER
from mme_runtime.models.serving_properties import read_settings

logger = logging.getLogger(__name__)


def is_our_handler(handler: str) -> bool:
    """Whether MMS names this container's handler (``handler_service``, with or without ``:handle``)."""
    return Path(handler.partition(":")[0]).stem == OUR_HANDLER


def container_reason(handler: str, config: Config) -> str | None:
    """Why no model of this container (or with this handler) can share a host; None when it can."""
    if not config.share_device:
        return "MME_SHARE_DEVICE=false"
    if not is_our_handler(handler):
        return f"its handler {handler} is not this container's"
    return None


def model_reason(model_dir: Path, config: Config) -> str | None:
    """Why this model needs a host of its own; None when it can share. Fetches code from S3 if the model uses it
    (cached for its load). A setting or code that cannot be read is the load's to report: it shares."""
    try:
        isolation = read_settings(model_dir, config).isolation
        if isolation == "process":
            return "serving.properties sets isolation=process"
        fetcher = CodeFetcher(config.cache_dir / "code", config.s3_timeout_seconds)
        code_dir, _ = locate_code(model_dir, config.submit_directory, fetcher)
    except (ModelLoadError, OSError) as exc:
        logger.debug("sharing check of %s deferred to its load: %s", model_dir, exc)
        return None
    if code_dir is None:
        return None
    if (code_dir / REQUIREMENTS).is_file():
        unmet = unmet_requirements((code_dir / REQUIREMENTS).read_text(encoding="utf-8", errors="replace"))
        if unmet:
            return f"its {REQUIREMENTS} asks for what the image does not have: {', '.join(unmet[:3])}"
    helpers = helper_modules(code_dir, config.program)
    if helpers and isolation != "shared" and code_dir == model_dir / "code":
        return (
            f"its code/ holds modules beside {config.program} ({', '.join(helpers[:3])}), imported by names another "
            "model of a shared host could hold (isolation=shared in serving.properties shares it all the same)"
        )
    return None


def helper_modules(code_dir: Path, program: str) -> list[str]:
    """The importable modules and packages in ``code_dir`` other than the script itself."""
    names = []
    for path in sorted(code_dir.iterdir()):
        if path.suffix == ".py" and path.name != program:
            names.append(path.name)
        elif path.is_dir() and (path / "__init__.py").is_file():
            names.append(f"{path.name}/")
    return names


def unmet_requirements(text: str) -> list[str]:
    """The lines of a requirements file that the installed packages do not satisfy. Options, URLs and anything pip
    alone understands count as unmet: only what can be checked here is trusted."""
    unmet = []
    for raw in text.splitlines():
        line = raw.split(" #", 1)[0].strip()
        if not line or line.startswith("#"):
            continue
        try:
            requirement = Requirement(line)
        except InvalidRequirement:
            unmet.append(line)
            continue
        if requirement.marker is not None and not requirement.marker.evaluate():
            continue  # not for this platform: pip would skip it too
        if requirement.url or requirement.extras or not _installed_satisfies(requirement):
            unmet.append(line)
    return unmet


def _installed_satisfies(requirement: Requirement) -> bool:
    try:
        version = metadata.version(requirement.name)
    except metadata.PackageNotFoundError:
        return False
    return requirement.specifier.contains(version, prereleases=True)
