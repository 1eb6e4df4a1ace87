"""Binding ZMQ sockets and the endpoint peers should connect to (shared by the buffer and the weight publisher)."""

from __future__ import annotations

import socket as net

import zmq

WILDCARD_HOSTS = ("0.0.0.0", "*", "::", "[::]")


def bind(socket: zmq.Socket, host: str, port: int) -> str:
    """Bind and return the endpoint peers connect to (a wildcard host is advertised as this node's address)."""
    if port == 0:
        port = socket.bind_to_random_port(f"tcp://{host}")
    else:
        socket.bind(f"tcp://{host}:{port}")
    return f"tcp://{advertised_host(host)}:{port}"


def advertised_host(host: str) -> str:
    """`host`, or for a wildcard bind (0.0.0.0, *, ::) the address of the interface that routes off this node."""
    if host not in WILDCARD_HOSTS:
        return host
    with net.socket(net.AF_INET, net.SOCK_DGRAM) as probe:
        try:
            probe.connect(("10.255.255.255", 1))  # UDP connect sends nothing; it only picks the outgoing interface
            return probe.getsockname()[0]
        except OSError:
            return net.gethostbyname(net.gethostname())
