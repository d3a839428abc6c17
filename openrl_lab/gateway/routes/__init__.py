"""The gateway's routes, one router per resource (all under /api/v1; the Hugging Face mirror under /hf, the
sandbox service under /sandbox)."""

from openrl_lab.gateway.routes import futures, hf, lab, rest, sampling, sandbox, sessions, training

ROUTERS = [
    sessions.router,
    training.router,
    sampling.router,
    futures.router,
    rest.router,
    rest.download_router,
    lab.router,
]
HF_ROUTER = hf.router  # at the root: huggingface_hub builds its URLs from HF_ENDPOINT=<base_url>/hf
SANDBOX_ROUTER = sandbox.router  # at the root too: SandboxFusion clients are given <base_url>/sandbox/run_code
