"""deploy/images: the two image build files, checked offline. No Docker engine runs here, so they are not built:
hadolint (from its PyPI wheel) lints them, and what they copy and run is checked against the repository and the
chart."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.deploy.chart import CONTROL_PLANE, REPO, one, render

IMAGES = REPO / "deploy" / "images"
DOCKERFILES = ("Dockerfile", "singleuser.Dockerfile")


@pytest.mark.server  # runs hadolint or helm
@pytest.mark.parametrize("name", DOCKERFILES)
def test_dockerfiles_pass_hadolint_offline(name):
    hadolint = Path(sys.executable).parent / "hadolint"
    out = subprocess.run([str(hadolint), "--no-color", str(IMAGES / name)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.parametrize("name", DOCKERFILES)
def test_what_the_images_copy_exists_and_their_dockerignore_lets_it_through(name):
    text = (IMAGES / name).read_text()
    allowed = {line[1:] for line in (IMAGES / f"{name}.dockerignore").read_text().splitlines() if line.startswith("!")}
    sources = [src for line in re.findall(r"^COPY (?!--from)(.+)$", text, re.M) for src in line.split()[:-1]]
    assert sources
    for src in sources:
        assert (REPO / src).exists(), src
        assert src in allowed, f"{src} is excluded by {name}.dockerignore"


@pytest.mark.server  # runs hadolint or helm
def test_the_image_user_is_the_one_the_chart_runs_as():
    assert re.search(r"^USER 10001:10001$", (IMAGES / "Dockerfile").read_text(), re.M)
    pod = one(render("values.yaml"), "Deployment", CONTROL_PLANE)["spec"]["template"]["spec"]
    assert (pod["securityContext"]["runAsUser"], pod["securityContext"]["fsGroup"]) == (10001, 10001)
