#!/usr/bin/env bash
# SkyRL 0.3.0's Tinker server (its JAX backend, on CPU) and the newest tinker SDK it accepts (0.24.1: 0.25 sends
# forward_backward as protobuf, which it does not parse), in a directory of their own, for benchmarks/vs_skyrl.py:
#
#     benchmarks/skyrl_env.sh /tmp/skyrl        # ~3 min, ~2.2 GB
#
# Two workarounds, both for SkyRL 0.3.0 as published:
# - skyrl/tinker/types.py imports TypedDict from typing, which pydantic refuses on Python < 3.12: patched to
#   typing_extensions;
# - its API server starts its engine with `uv run ... -m skyrl.tinker.engine` and checks that its own parent is
#   `uv run ... python -m skyrl.tinker.api`: DIR/bin/uv stands in for uv (not installed here), running the venv's
#   python.
set -euo pipefail
DIR=$(realpath -m "${1:?usage: skyrl_env.sh DIR}")
mkdir -p "$DIR/bin"
python3.11 -m venv "$DIR/venv"
"$DIR/venv/bin/pip" install -q "torch==2.13.0"  # the CPU wheel on disk; skyrl's torch import would pull CUDA
"$DIR/venv/bin/pip" install -q "skyrl[tinker,jax]==0.3.0" "jax[cpu]" "torch==2.13.0" "tinker==0.24.1"
TYPES=$("$DIR/venv/bin/python" -c 'import importlib.util as u; print(u.find_spec("skyrl").submodule_search_locations[0])')/tinker/types.py
sed -i 's/^from typing import Annotated, Any, Literal, TypedDict$/from typing import Annotated, Any, Literal\nfrom typing_extensions import TypedDict/' "$TYPES"
cat > "$DIR/bin/uv" <<SHIM
#!/usr/bin/env bash
# Stands in for \`uv run\` (skyrl_env.sh): "-m MODULE ARGS" is exec'd; "python ARGS" runs as a child, so that the
# API server sees this script as its parent.
PY="$DIR/venv/bin/python"
args=("\$@")
for ((i=0; i<\${#args[@]}; i++)); do
  if [[ "\${args[\$i]}" == "-m" ]]; then exec "\$PY" "\${args[@]:\$i}"; fi
  if [[ "\${args[\$i]}" == python* ]]; then
    "\$PY" "\${args[@]:\$((i+1))}" & child=\$!
    trap 'kill -TERM \$child 2>/dev/null' TERM INT
    while kill -0 \$child 2>/dev/null; do wait \$child; rc=\$?; done
    exit \$rc
  fi
done
echo "uv stand-in: no '-m' or 'python' in: \$*" >&2
exit 2
SHIM
chmod +x "$DIR/bin/uv"
"$DIR/venv/bin/python" -c 'import skyrl.tinker.api, tinker; print("skyrl env ready: tinker", tinker.__version__)'
