"""Ports for servers that bind them later: chosen where no automatic assignment can take them first."""

import socket

from workers.net import _ephemeral_range, free_port


def test_free_ports_lie_below_the_ephemeral_range_where_bind_0_never_lands():
    low, high = _ephemeral_range()
    ports = [free_port() for _ in range(20)]
    assert all(1024 <= port < low for port in ports)
    port = ports[-1]
    automatic = []  # what SGLang's scheduler does for its gloo sockets while its server starts
    try:
        for _ in range(200):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind(("127.0.0.1", 0))
            automatic.append(sock)
        assert all(low <= sock.getsockname()[1] <= high for sock in automatic)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as server:
            server.bind(("127.0.0.1", port))  # still the server's to take
    finally:
        for sock in automatic:
            sock.close()
