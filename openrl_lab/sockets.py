"""TCP sockets without Nagle's algorithm, for every socket the project opens; `HOST:PORT` addresses parsed.

Our peers answer small requests with small replies written in more than one piece (uvicorn's h11 writes a
response's head and body separately; httpx writes a POST's head, then its body). With Nagle on, the second
write waits for the peer's delayed ACK: ~40 ms per request on Linux. asyncio would set TCP_NODELAY itself,
but only on sockets whose `proto` is IPPROTO_TCP, which a plain `socket.socket(AF_INET)` is not. So:
listening sockets carry the option (accepted sockets inherit it on Linux, and are made with the right
`proto`), and clients set it on their side. (gRPC, the orchestrator's and the kernels' protocol, sets it
itself.)
"""

from __future__ import annotations

import ipaddress
import re
import socket
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import httpx

# The form httpx/httpcore take as `socket_options`.
NODELAY = [(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)]


def listening_socket(host: str, port: int, backlog: int = 128) -> socket.socket:
    """A bound, listening TCP socket whose accepted connections have TCP_NODELAY."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.bind((host, port))
        sock.listen(backlog)
    except BaseException:
        sock.close()
        raise
    return sock


def http_client(**kwargs: Any) -> httpx.Client:
    """An `httpx.Client` whose connections have TCP_NODELAY (a POST's head and body go in two writes)."""
    import httpx

    return httpx.Client(transport=httpx.HTTPTransport(socket_options=NODELAY), **kwargs)


def lab_answers(base_url: str, timeout: float = 2.0) -> bool:
    """Whether an OpenRL Lab answers its health check at `base_url`."""
    import httpx

    try:
        with http_client(timeout=timeout) as http:
            return http.get(f"{base_url.rstrip('/')}/api/v1/healthz").status_code == 200
    except httpx.HTTPError:
        return False


def async_http_client(**kwargs: Any) -> httpx.AsyncClient:
    """The asynchronous twin of `http_client`."""
    import httpx

    return httpx.AsyncClient(transport=httpx.AsyncHTTPTransport(socket_options=NODELAY), **kwargs)


ADDRESS = re.compile(r"(?:\[([0-9A-Fa-f:.]+)\]|([A-Za-z0-9.-]{1,253})):(\d{1,5})")


def parse_address(text: str, what: str = "address", any_port: bool = False) -> tuple[str, int]:
    """`host:port` (`[v6]:port`) -> (host, port); ValueError naming the problem. `any_port`: port 0 (any free
    one) is allowed."""
    m = ADDRESS.fullmatch(text or "")
    port = int(m.group(3)) if m else -1
    if not m or not (0 if any_port else 1) <= port < 65536:
        raise ValueError(f"{what} {text[:100]!r} is not HOST:PORT")
    return m.group(1) or m.group(2), port


def is_loopback_host(host: str) -> bool:
    """Whether `host` (a name or an address, `[v6]` brackets allowed) is this machine's loopback."""
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
