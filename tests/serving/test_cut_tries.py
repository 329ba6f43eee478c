"""A try the router cut never reaches its replica later (wire.upstream.upstream_session).

Behind a partition the bytes of a completion the router sent stay unacknowledged in its kernel; the router cuts the
try (the replica left routing) and re-sends it elsewhere. Closed gracefully, the connection would still deliver it
after the heal, to a replica that may have unloaded its adapter by then: the chaos run's `worker_partition` counted
one such ghost as a misroute. Here the replica is a socket that reads nothing until the try is cut (a tiny receive
window keeps most of the request in the router's kernel, as a partition does), then reads whatever still comes.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading

from grpo_lab.serving.wire.upstream import Replica, UpstreamClient, upstream_session

# larger than the stalled replica's receive window, small enough for the router's kernel to take it all at once
BODY = json.dumps({"model": "trl-policy-v4", "prompt": list(range(1500)), "end": "END-OF-REQUEST"}).encode()


class StalledReplica:
    """Accepts one connection, reads nothing until `read_rest()`, then everything until EOF, reset or timeout."""

    def __init__(self):
        self.listener = socket.socket()
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)  # the kernel's minimum window
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen()
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self.arriving = threading.Event()
        self.conn: socket.socket | None = None
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        self.conn, _ = self.listener.accept()
        self.conn.settimeout(5)
        self.conn.recv(1, socket.MSG_PEEK)  # the request began to arrive (nothing read: the window stays shut)
        self.arriving.set()

    def read_rest(self, timeout_s: float = 5.0) -> tuple[bytes, str]:
        """(bytes received, how the connection ended: "eof", "reset" or "timeout")."""
        self.conn.settimeout(timeout_s)
        received = b""
        try:
            while chunk := self.conn.recv(65536):
                received += chunk
            return received, "eof"
        except ConnectionResetError:
            return received, "reset"
        except TimeoutError:
            return received, "timeout"
        finally:
            self.conn.close()
            self.listener.close()


def test_a_cut_try_is_dropped_with_its_connection_not_delivered_after():
    replica_side = StalledReplica()

    async def send_then_cut() -> None:
        async with upstream_session() as session:
            client, replica = UpstreamClient(session, None), Replica(0, replica_side.url)
            call = asyncio.ensure_future(client.call(replica, "POST", "/v1/completions", data=BODY, timeout=30))
            replica.calls.add(call)  # as Forwarder._attempt does
            assert await asyncio.to_thread(replica_side.arriving.wait, 5)  # part in its window, the rest queued here
            assert not call.done()
            replica.cut_calls()  # it left routing
            await asyncio.gather(call, return_exceptions=True)
            await asyncio.sleep(0.2)  # the connection's close has run

    asyncio.run(send_then_cut())
    received, ended = replica_side.read_rest()
    assert received.startswith(b"POST /v1/completions")  # it was sent...
    assert b"END-OF-REQUEST" not in received, ended  # ...but what was still queued never arrives
    assert ended == "reset"
