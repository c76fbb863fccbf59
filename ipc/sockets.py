"""ZeroMQ endpoints of an engine core: addresses, loopback-by-default binding and CURVE authentication.

An engine core listens on two endpoints derived from one address: requests come in on the address itself
(ROUTER; clients connect DEALERs) and outputs go out on a second ROUTER, so each client's outputs are routed
to that client alone. For `tcp://host:port` the output endpoint is `tcp://host:port+1`; for `ipc://path` it
is `ipc://path.out`.
"""
from __future__ import annotations

import contextlib
import ipaddress
import os
import socket
import tempfile
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")
_PRIVATE_DIR_PREFIX = "pagedserve-"


@dataclass(frozen=True)
class EngineEndpoints:
    input: str
    output: str

    @classmethod
    def from_address(cls, address: str) -> EngineEndpoints:
        if address.startswith("ipc://"):
            return cls(address, address + ".out")
        if address.startswith("tcp://"):
            host, _, port = address[len("tcp://"):].rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65535:
                raise ValueError(f"engine address {address!r} must look like tcp://HOST:PORT (PORT and PORT+1 "
                                 "are used)")
            return cls(address, f"tcp://{host}:{int(port) + 1}")
        raise ValueError(f"engine address {address!r} must start with tcp:// or ipc://")

    @property
    def is_loopback(self) -> bool:
        """ipc:// is local to the machine; tcp:// is local only on a loopback host."""
        if self.input.startswith("ipc://"):
            return True
        host = self.input[len("tcp://"):].rpartition(":")[0].strip("[]")
        if host in LOOPBACK_HOSTS:
            return True
        try:
            return ipaddress.ip_address(host).is_loopback
        except ValueError:
            return False


def private_ipc_address() -> str:
    """An ipc:// address in a fresh directory only this user can enter."""
    return f"ipc://{tempfile.mkdtemp(prefix=_PRIVATE_DIR_PREFIX)}/engine"


def free_tcp_address(host: str = "127.0.0.1") -> str:
    """A tcp:// address whose port and port+1 were both free a moment ago."""
    for _ in range(100):
        with socket.socket() as probe:
            probe.bind((host, 0))
            port = probe.getsockname()[1]
        if port + 1 < 65535 and _port_is_free(host, port + 1):
            return f"tcp://{host}:{port}"
    raise RuntimeError(f"found no two adjacent free ports on {host}")


def _port_is_free(host: str, port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind((host, port))
        except OSError:
            return False
    return True


def remove_ipc_files(endpoints: EngineEndpoints) -> None:
    """Remove an engine's ipc:// socket files, and the directory private_ipc_address made for them."""
    for endpoint in (endpoints.input, endpoints.output):
        if endpoint.startswith("ipc://"):
            path = Path(endpoint[len("ipc://"):])
            path.unlink(missing_ok=True)
            if path.parent.name.startswith(_PRIVATE_DIR_PREFIX):
                with contextlib.suppress(OSError):  # not empty yet: the other endpoint's file
                    path.parent.rmdir()


@dataclass(frozen=True)
class CurveKeys:
    """One key pair shared by an engine core and its clients: the server's identity and the only client key
    it accepts. Made by `zmq.auth.create_certificates(dir, name)`; the file is `name.key_secret`."""

    public: bytes
    secret: bytes

    @classmethod
    def load(cls, key_file: str | os.PathLike) -> CurveKeys:
        path = Path(key_file)
        if not path.is_file():
            raise ValueError(f"CURVE key file {path} does not exist (make one with "
                             "python -c \"import zmq.auth; zmq.auth.create_certificates('DIR', 'engine')\")")
        public, secret = zmq.auth.load_certificate(path)
        if secret is None:
            raise ValueError(f"CURVE key file {path} holds no secret key (give the .key_secret file)")
        return cls(public, secret)


class _SharedKeyOnly:
    """ZAP credentials check: only clients presenting the shared public key get in."""

    def __init__(self, public_key: bytes) -> None:
        self.public_key = public_key

    def callback(self, domain: str, client_key: bytes) -> bool:
        return client_key == self.public_key


def check_binding_is_safe(endpoints: EngineEndpoints, keys: CurveKeys | None, insecure_loopback: bool = False) -> None:
    """Every client must hold a credential: on ipc:// the socket file's permissions (only its owner may connect);
    on tcp:// a CURVE key, loopback included (any local user reaches it), unless `insecure_loopback` says the
    host's users are all trusted."""
    if keys is not None or endpoints.input.startswith("ipc://"):
        return
    if not endpoints.is_loopback:
        raise ValueError(f"an engine core listening beyond loopback ({endpoints.input}) must be given a CURVE "
                         "key file (curve_key_file); clients then need the same file")
    if not insecure_loopback:
        raise ValueError(f"an engine core on {endpoints.input} must be given a CURVE key file (curve_key_file): "
                         "every user of this host can reach a loopback port. Use an ipc:// address (only its "
                         "owner may connect), or accept that with --engine-insecure-loopback")


def start_authenticator(context: zmq.Context, keys: CurveKeys) -> ThreadAuthenticator:
    authenticator = ThreadAuthenticator(context)
    authenticator.start()
    authenticator.configure_curve_callback("*", _SharedKeyOnly(keys.public))
    return authenticator


def bind_router(context: zmq.Context, endpoint: str, keys: CurveKeys | None) -> zmq.Socket:
    sock = context.socket(zmq.ROUTER)
    _common_options(sock)
    if keys is not None:
        sock.curve_secretkey, sock.curve_publickey, sock.curve_server = keys.secret, keys.public, True
    sock.bind(endpoint)
    return sock


def connect_dealer(context: zmq.Context, endpoint: str, identity: bytes, keys: CurveKeys | None) -> zmq.Socket:
    sock = context.socket(zmq.DEALER)
    _common_options(sock)
    sock.setsockopt(zmq.ROUTING_ID, identity)
    if keys is not None:
        sock.curve_secretkey, sock.curve_publickey, sock.curve_serverkey = keys.secret, keys.public, keys.public
    sock.connect(endpoint)
    return sock


def _common_options(sock: zmq.Socket) -> None:
    sock.setsockopt(zmq.LINGER, 0)
    # Unbounded queues: back-pressure is the scheduler's job, and a full queue would drop or block silently.
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    # Heartbeats notice a peer that vanished without closing its connection (a pulled cable, a frozen host).
    sock.setsockopt(zmq.HEARTBEAT_IVL, 1000)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, 5000)
