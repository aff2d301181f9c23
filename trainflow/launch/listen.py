"""Where a launch listens: on loopback for one node, else only on the interface its nodes meet
through, never on every interface.

torch's `TCPStore` server listens on all interfaces (`0.0.0.0`/`::`) whatever host it is
given. A launch hosts two of them (the c10d rendezvous store, and the store the ranks share
at `MASTER_PORT`), and a leader hosts its launch board: each would take connections from the
whole network, unauthenticated. Here a store's server gets a socket already bound to one
address (`master_listen_fd`). The address is the one this node reaches the rendezvous (or
board) host through: 127.0.0.1 for a launch on one node, which meets at `127.0.0.1:0`.
"""

import contextlib
import ipaddress
import socket
from typing import Any

LOOPBACK = "127.0.0.1"


def _resolve(host: str) -> tuple[socket.AddressFamily, str]:
    family, _, _, _, sockaddr = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)[0]
    return family, str(sockaddr[0])


def node_address(host: str) -> str:
    """This node's address toward `host`: `host` itself when it is one of this machine's
    addresses (loopback included), else the address of the interface the route to it uses.

    Raises:
        OSError: `host` does not resolve, or no route leads to it.
    """
    family, ip = _resolve(host.strip("[]"))
    if ipaddress.ip_address(ip).is_loopback:
        return ip
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect((ip, 9))  # UDP: no packet is sent, the kernel only picks the route
        return str(probe.getsockname()[0])


def listening_fd(address: str, port: int) -> tuple[int, int]:
    """A TCP socket listening on `address:port` only (`port` 0: any free one), as a file
    descriptor a `TCPStore` server takes over, and its port.

    Raises:
        OSError: the address is not this machine's, or the port is taken.
    """
    family, ip = _resolve(address)
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((ip, port))
        sock.listen(512)
        bound = int(sock.getsockname()[1])
    except BaseException:
        sock.close()
        raise
    return sock.detach(), bound


def tcp_store_server(store_cls: Any, address: str, port: int, **kwargs: Any) -> Any:
    """A `TCPStore` server (`store_cls`) that listens on `address:port` only.

    torch's libuv backend takes a listening socket from 2.8 on; before (LLM Foundry's
    environment has 2.7) it raises `NotImplementedError`, and the server is made again on
    torch's older backend, which does.

    Raises:
        RuntimeError: the socket cannot be bound there (what `TCPStore` raises itself).
    """
    try:
        return _server_on_fd(store_cls, address, port, **kwargs)
    except NotImplementedError:
        if kwargs.get("use_libuv") is False:
            raise
        return _server_on_fd(store_cls, address, port, **{**kwargs, "use_libuv": False})


def _server_on_fd(store_cls: Any, address: str, port: int, **kwargs: Any) -> Any:
    try:
        fd, bound = listening_fd(address, port)
    except OSError as exc:
        raise RuntimeError(f"cannot listen on {address}:{port}: {exc}") from exc
    try:
        return store_cls(address, bound, is_master=True, master_listen_fd=fd, **kwargs)
    except BaseException:
        with contextlib.suppress(OSError):
            socket.close(fd)
        raise


def elastic_store_server(address: str) -> Any:
    """What `compat.torch.bind_elastic_stores` takes: a `TCPStore` server on `address` only,
    for the agent's rendezvous store and the store its ranks share (whose `MASTER_ADDR` is the
    agent's `local_addr`, to be set to `address` as well)."""
    from torch.distributed import TCPStore

    def server(port: int, **kwargs: Any) -> Any:
        return tcp_store_server(TCPStore, address, port, **kwargs)

    return server
