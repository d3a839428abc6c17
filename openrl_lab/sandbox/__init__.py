"""The sandbox: model-written code (an RL reward runs what the model wrote) run in isolation on this host.

- `isolation.py`: one sandbox (bubblewrap with every namespace unshared, seccomp, rlimits, a tmpfs scratch),
  `Limits`, `Execution`, `check_host()`; its module docstring says what is isolated how, and why.
- `_stub.py`: the sandbox's PID 1, run inside it (never imported): waits warm, runs one program, reports.
- `pool.py`: `SandboxPool`, warm single-use sandboxes refilled in the background; `run()` is the entry point.
- `protocol.py`, `serving.py`, `client.py`: the SandboxFusion-compatible HTTP API over the pool, and its client;
  `serving.py`'s executors run programs in this host's pool or forward them to a sandbox server.
- `server.py`: that server (`openrl-lab sandbox serve`, the chart's sandbox Pods): the same routes behind a service
  token. `isolation.py`'s `PodSandbox` is the isolation inside such a Pod (OPENRL_SANDBOX_ISOLATION=pod).

torch-free (tests/test_layering.py).
"""
