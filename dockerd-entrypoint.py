#!/usr/bin/env python3
"""Container entrypoint: `serve` (the default) runs MMS with our handler in the foreground; anything
else is exec'd.

Kept thin: the logic lives in mme_runtime (config, properties, supervisor) where it can be tested.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

from mme_runtime.base.child_processes import one_arena
from mme_runtime.base.config import Config
from mme_runtime.base.errors import EXIT_CONFIG, ConfigError
from mme_runtime.base.locks import hold_runtime_dir
from mme_runtime.base.logs import ENTRYPOINT_FORMAT, configure_logging
from mme_runtime.base.nvidia import gpu_count
from mme_runtime.operations.cloudwatch_metrics import start as start_cloudwatch
from mme_runtime.operations.metrics_exporter import start as start_metrics
from mme_runtime.processes.frontend import (
    ensure_mme_properties,
    frontend_command,
    jvm_arguments,
    mms_properties,
    prepare_mms_home,
    write_properties,
)
from mme_runtime.processes.supervisor import Supervisor

logger = logging.getLogger("mme.entrypoint")

TEMPLATE = Path(__file__).resolve().with_name("mme-mms.properties")


def serve() -> int:
    configure_logging(logging.INFO, ENTRYPOINT_FORMAT)
    try:
        config = Config.from_process_env()
        if (environment := config.entrypoint_environment()) is not None:
            execute_again(environment)
        hold_runtime_dir(config.runtime_dir, config.port)  # held until this process ends
        mme = ensure_mme_properties(config.effective_properties_file, TEMPLATE)
        config = config.with_properties(mme)
    except ConfigError as exc:
        logger.error("invalid configuration: %s", exc)
        return EXIT_CONFIG
    configure_logging(config.log_level, ENTRYPOINT_FORMAT)
    one_arena()  # before the threads: the scrapes' heap is given back after each

    workers = config.workers_per_model or max(1, gpu_count())
    properties_file = config.runtime_dir / "mms.properties"
    properties = mms_properties(config, mme, workers)
    write_properties(properties_file, properties)
    home = prepare_mms_home(config.runtime_dir)
    logger.info(
        "effective configuration: %s workers_per_model_effective=%d", config.describe(), workers
    )

    command = frontend_command(config, properties_file, home, jvm_arguments(config, mme))
    env = config.child_environment({"MODEL_SERVER_HOME": str(home), "PYTHONUNBUFFERED": "1"})
    warm_command = [sys.executable, "-m", "mme_runtime.processes.warm_start"]
    model_metrics = start_metrics(config)
    cloudwatch = start_cloudwatch(config, model_metrics)
    supervisor = Supervisor(
        config=config,
        command=command,
        env=env,
        cwd=config.runtime_dir,
        warm_command=warm_command,
        model_metrics=model_metrics,
    )
    supervisor.install_signal_handlers()
    status = supervisor.run()
    if cloudwatch is not None:
        cloudwatch.stop()  # the last lines: what happened since the previous ones
    return status


def execute_again(environment: dict[str, str]) -> None:
    """This process, started again in ``environment`` (same pid); where that cannot be done, it
    carries on as it is, saying so."""
    if not sys.executable:
        logger.warning("Python's allocator kept: the interpreter's path is unknown")
        return
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], environment)
    except (OSError, ValueError) as exc:
        logger.warning("Python's allocator kept: cannot execute %s again: %s", sys.executable, exc)


def main(argv: list[str]) -> int:
    if not argv or argv[0] == "serve":
        return serve()
    # Any other command runs as given, replacing this process (so it gets the signals and the exit
    # status).
    os.execvp(argv[0], argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
