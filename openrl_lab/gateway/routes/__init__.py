"""The gateway's routes, one router per resource (all under /api/v1; the Hugging Face mirror under /hf)."""

from openrl_lab.gateway.routes import futures, hf, lab, rest, sampling, sessions, training

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
