"""The gateway's routes, one router per resource (all under /api/v1)."""

from openrl_lab.gateway.routes import futures, lab, rest, sampling, sessions, training

ROUTERS = [sessions.router, training.router, sampling.router, futures.router, rest.router, lab.router]
