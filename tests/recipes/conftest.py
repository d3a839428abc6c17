"""The recipes' tests get their own lab (one for the package): RL runs put hundreds of phases on a lab's
timeline, which the session `lab` shares with tests that read that timeline (tests/timeslice)."""

from __future__ import annotations

import pytest

from ..conftest import running_lab, sdk_client


@pytest.fixture(scope="package")
def recipes_lab(tmp_path_factory):
    yield from running_lab(tmp_path_factory.mktemp("recipes-lab-home"))


@pytest.fixture(scope="package")
def service(recipes_lab):
    """Overrides the session-wide `service` for this package: a client of the recipes' own lab."""
    yield from sdk_client(recipes_lab)
