"""The recipes' tests get their own lab (one for the package): RL runs put hundreds of phases on a lab's
timeline, which the session `lab` shares with tests that read that timeline (tests/timeslice)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="package")
def recipes_lab(tmp_path_factory):
    from openrl_lab.server import LabServer

    server = LabServer(tmp_path_factory.mktemp("recipes-lab-home"))
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="package")
def service(recipes_lab):
    """Overrides the session-wide `service` for this package: a client of the recipes' own lab."""
    import tinker

    client = tinker.ServiceClient(base_url=recipes_lab.base_url, api_key=recipes_lab.api_key)
    yield client
    client.close("success").result()
