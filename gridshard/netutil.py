"""A free TCP port on the loopback interface (rendezvous of local process groups)."""
import socket


def free_port() -> int:
    """A port the OS reports free on 127.0.0.1 right now (it can be taken before use; local
    launches only)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
