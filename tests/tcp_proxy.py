"""A TCP proxy on loopback that can be shut and reopened on the same port.

Shut, it refuses connections (nothing listens) and resets the open ones: an S3
endpoint that went away.  Reopened, the same address works again: the endpoint came
back.  The bytes in between are passed through untouched.  ``accepted`` counts the
connections it took.
"""

from __future__ import annotations

import contextlib
import socket
import threading


class TcpProxy:
    def __init__(self, target_host: str, target_port: int) -> None:
        self.target = (target_host, target_port)
        self._lock = threading.Lock()
        self._conns: list[socket.socket] = []
        self._listener: socket.socket | None = None
        self.accepted = 0
        probe = socket.socket()
        probe.bind(("127.0.0.1", 0))
        self.port = int(probe.getsockname()[1])
        probe.close()
        self.reopen()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def reopen(self) -> None:
        """Listen (again) on the same port."""
        srv = socket.socket()
        srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        srv.bind(("127.0.0.1", self.port))
        srv.listen(64)
        with self._lock:
            self._listener = srv
        threading.Thread(target=self._accept, args=(srv,), daemon=True).start()

    def shut(self) -> None:
        """Stop listening (new connections are refused) and reset every open one."""
        with self._lock:
            srv, self._listener = self._listener, None
            conns, self._conns = self._conns, []
        if srv is not None:
            with contextlib.suppress(OSError):
                srv.shutdown(socket.SHUT_RDWR)
            srv.close()
        for c in conns:
            with contextlib.suppress(OSError):
                c.shutdown(socket.SHUT_RDWR)
            c.close()

    def _accept(self, srv: socket.socket) -> None:
        while True:
            try:
                client, _ = srv.accept()
            except OSError:
                return  # shut
            try:
                upstream = socket.create_connection(self.target)
            except OSError:
                client.close()
                continue
            with self._lock:
                if self._listener is not srv:
                    client.close()
                    upstream.close()
                    return
                self._conns += [client, upstream]
                self.accepted += 1
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            with contextlib.suppress(OSError):
                dst.shutdown(socket.SHUT_WR)
