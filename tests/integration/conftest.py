"""The server that integration modules share when none of their tests needs a fresh one or other settings."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from serving import RunningServer, start_server


@pytest.fixture(scope="session")
def shared_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    """One server with the default environment for the whole session (a start costs about 3 to 6 s). Use it through
    ``serving.borrowed``: a module's own view of the log, and its models unloaded when it is done."""
    with start_server(tmp_path_factory.mktemp("shared")) as running:
        yield running
