"""tests/vllm write nothing outside temporary directories: vLLM's compile cache and config (~/.cache/vllm,
~/.config/vllm), torch inductor's cache, and any XDG cache go to a folder of this session, removed at its end.
Set here, before any test imports vLLM (it reads these at import); kernels the tests start inherit them."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from pathlib import Path

_TMP = Path(tempfile.mkdtemp(prefix="openrl-lab-vllm-tests-", dir=os.environ.get("PYTEST_TMPROOT")))
atexit.register(shutil.rmtree, _TMP, ignore_errors=True)

os.environ["VLLM_CACHE_ROOT"] = str(_TMP / "vllm-cache")
os.environ["VLLM_CONFIG_ROOT"] = str(_TMP / "vllm-config")
os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(_TMP / "inductor")
os.environ["XDG_CACHE_HOME"] = str(_TMP / "xdg-cache")
os.environ["XDG_CONFIG_HOME"] = str(_TMP / "xdg-config")
os.environ["VLLM_NO_USAGE_STATS"] = "1"  # no usage report (nor its file under the config root)
os.environ["DO_NOT_TRACK"] = "1"
