"""Hosts of their own on one machine, for the tests: network namespaces joined by veth pairs to one bridge, a cable
that can be pulled (`partition`) and plugged back (`heal`), and a TCP proxy that slows a link down.

    with shared_network() as network:            # this run's bridge and subnet, 10.213.N.0/24 (N free, locked)
        head = network.add_host("head")          # namespace grpo-<run>-head, eth0 = 10.213.N.2, cable on the bridge
        proc = network.popen("head", ["ray", "start", ...])   # `ip netns exec`: the PID is the command's own
        with network.inside("head"):             # this thread's new sockets live in the head namespace
            ray.init(address=...)
        network.partition("head"); network.heal("head")
        network.remove_host("head")

**Layout.** Each host is a namespace whose only interface besides loopback is `eth0`, one end of a veth pair; the
other end (`gl<run>v<k>`) is a port of the run's bridge `gl<run>br`. The bridge lives in the root namespace and
carries one address, `.1`: the processes that stay in the root namespace (the pytest process outside the Ray tier,
and the replicas, sidecars and publishers the S3 tests start) must reach the S3 server, and they cannot all be moved
into a namespace; a bridge in a namespace of its own would need a root-side link with an address anyway. The hosts
get no default route, so from inside a namespace the machine's own interface address cannot even be dialled: what
works there works between hosts with distinct addresses. Names carry a random run id and the subnet is claimed with
a lock file (`/tmp/grpo-lab-netns-10.213.N.lock`, holding the run id), so two runs never collide; a run killed
before its cleanup leaves its run id in the lock file, and the next run to claim that subnet removes its devices.

**Partition** takes the bridge-side end of the host's veth down, as pulling the cable at the switch: the host keeps
its address and routes and its packets are dropped silently (no connection is refused), until `heal`.

**Delay**: this kernel has no `netem`, so `DelayProxy` is a TCP proxy of the tests' own that holds every chunk
`delay_ms` before passing it on, each way; a client dials the proxy instead of the server. It runs in a thread of
this process (optionally inside a namespace) or as its own process:

    python tests/netns.py proxy --listen 10.213.N.3:0 --target 10.213.N.3:8001 --delay-ms 200   # prints READY <port>

Namespaces need root and `ip` (iproute2): `unavailable_reason()` says what is missing; `require_or_skip()` skips with
it, or fails where `GRPO_LAB_REQUIRE_NETNS=1` (CI) says namespaces must be there.
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import contextlib
import ctypes
import fcntl
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import pytest

REQUIRE_ENV = "GRPO_LAB_REQUIRE_NETNS"
SUBNET_PREFIX = "10.213"  # subnets 10.213.N.0/24, used only on the bridges and namespaces the tests make
SUBNET_RANGE = range(7, 250)
LOCK_DIR = Path(tempfile.gettempdir())
CLONE_NEWNET = 0x40000000
_libc = ctypes.CDLL(None, use_errno=True)
# the namespace this module was imported in (the root one): `ip` runs there whichever namespace the caller is in
_ROOT_NETNS = os.open("/proc/thread-self/ns/net", os.O_RDONLY) if os.path.exists("/proc/thread-self") else None


class NetnsError(RuntimeError):
    """An `ip` command failed."""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, stdin=subprocess.DEVNULL,
                          preexec_fn=_in_root_netns, pass_fds=(_ROOT_NETNS,))
    if check and done.returncode != 0:
        raise NetnsError(f"ip {' '.join(args)}: {done.stderr.strip()}")
    return done


# -- can namespaces be made here ---------------------------------------------------------------------------------
_reason: list[str | None] = []


def unavailable_reason() -> str | None:
    """Why network namespaces cannot be made here (None: they can). Probed once: a namespace made and removed."""
    if not _reason:
        _reason.append(_probe())
    return _reason[0]


def _probe() -> str | None:
    if not sys.platform.startswith("linux"):
        return "network namespaces are Linux-only"
    if shutil.which("ip") is None:
        return "no `ip` command (iproute2: apt-get install iproute2)"
    if os.geteuid() != 0:
        return "network namespaces need root (`ip netns add`); run the tests as root, as CI does"
    name = f"grpo-probe-{uuid.uuid4().hex[:8]}"
    made = _ip("netns", "add", name, check=False)
    if made.returncode != 0:
        return f"`ip netns add` failed: {made.stderr.strip()}"
    _ip("netns", "del", name, check=False)
    return None


def required() -> bool:
    return os.environ.get(REQUIRE_ENV) == "1"


def require_or_skip(what: str) -> None:
    """Skip `what` with the reason namespaces cannot be made, or fail where they are required (CI)."""
    reason = unavailable_reason()
    if reason is None:
        return
    message = f"{what} needs network namespaces: {reason}"
    if required():
        pytest.fail(f"{message} ({REQUIRE_ENV}=1 requires them)", pytrace=False)
    pytest.skip(message)


# -- the network ---------------------------------------------------------------------------------------------------
@dataclass
class Host:
    """One namespace: `eth0` at `address`, its cable `veth` (the bridge-side end, in the root namespace)."""

    role: str
    netns: str
    address: str
    veth: str


@dataclass
class Network:
    """A bridge in the root namespace with `.1`, and hosts (namespaces) plugged into it, `.2` onwards."""

    run_id: str = field(default_factory=lambda: uuid.uuid4().hex[:6])
    subnet: int = 0
    hosts: dict[str, Host] = field(default_factory=dict)
    _lock_fd: int | None = None
    _next: int = 2

    @property
    def bridge(self) -> str:
        return f"gl{self.run_id}br"

    @property
    def gateway(self) -> str:
        """The bridge's address: where a root-namespace process is on this network."""
        return f"{SUBNET_PREFIX}.{self.subnet}.1"

    def create(self) -> Network:
        self.subnet, self._lock_fd = _claim_subnet(self.run_id)
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            # bridged frames must not meet the host's iptables FORWARD policy (br_netfilter, e.g. Docker's DROP)
            _ip("link", "set", self.bridge, "type", "bridge", "nf_call_iptables", "0", check=False)
            _ip("addr", "add", f"{self.gateway}/24", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
        except BaseException:
            self.destroy()
            raise
        return self

    def add_host(self, role: str) -> Host:
        """A namespace for `role`, with the next address of the subnet, plugged into the bridge."""
        if role in self.hosts:
            raise ValueError(f"host {role!r} exists already")
        host = Host(role, f"grpo-{self.run_id}-{role}", f"{SUBNET_PREFIX}.{self.subnet}.{self._next}",
                    f"gl{self.run_id}v{self._next}")
        self._next += 1
        self.hosts[role] = host
        try:
            _ip("netns", "add", host.netns)
            _ip("link", "add", host.veth, "type", "veth", "peer", "name", "eth0", "netns", host.netns)
            _ip("link", "set", host.veth, "master", self.bridge, "up")
            _ip("-n", host.netns, "addr", "add", f"{host.address}/24", "dev", "eth0")
            _ip("-n", host.netns, "link", "set", "eth0", "up")
            _ip("-n", host.netns, "link", "set", "lo", "up")
        except BaseException:
            self.remove_host(role)
            raise
        return host

    def remove_host(self, role: str) -> None:
        """Unplug and remove `role`'s namespace (safe to call twice). Its processes must have been stopped."""
        host = self.hosts.pop(role, None)
        if host is not None:
            _ip("link", "del", host.veth, check=False)  # takes eth0 with it, even if a process pins the namespace
            _ip("netns", "del", host.netns, check=False)

    def destroy(self) -> None:
        """Every host, the bridge and the subnet's claim; safe to call twice."""
        for role in list(self.hosts):
            self.remove_host(role)
        if self._lock_fd is not None:
            _ip("link", "del", self.bridge, check=False)
            _release_subnet(self._lock_fd)
            self._lock_fd = None

    # -- using it ------------------------------------------------------------------------------------------------
    def address(self, role: str) -> str:
        return self.hosts[role].address

    def command(self, role: str, argv: list[str]) -> list[str]:
        """`argv` run inside `role`'s namespace (`ip netns exec` execs it: the PID is the command's own)."""
        return ["ip", "netns", "exec", self.hosts[role].netns, *argv]

    def popen(self, role: str, argv: list[str], **kwargs) -> subprocess.Popen:
        return subprocess.Popen(self.command(role, argv), **kwargs)

    def pids(self, role: str) -> list[int]:
        """The processes living in `role`'s namespace (e.g. what a failed start left behind)."""
        inode = os.stat(f"/run/netns/{self.hosts[role].netns}").st_ino
        found = []
        for entry in os.listdir("/proc"):
            try:
                if entry.isdigit() and os.stat(f"/proc/{entry}/ns/net").st_ino == inode:
                    found.append(int(entry))
            except OSError:
                continue
        return found

    def partition(self, role: str) -> None:
        """Pull `role`'s cable: its packets are dropped until `heal`."""
        _ip("link", "set", self.hosts[role].veth, "down")

    def heal(self, role: str) -> None:
        _ip("link", "set", self.hosts[role].veth, "up")

    def enter(self, role: str) -> int:
        """Move the calling thread into `role`'s namespace (threads and processes it starts from now on follow);
        returns a handle of the namespace it was in, for `leave`."""
        return enter_netns(f"/run/netns/{self.hosts[role].netns}")

    @staticmethod
    def leave(handle: int) -> None:
        leave_netns(handle)

    @contextlib.contextmanager
    def inside(self, role: str):
        handle = self.enter(role)
        try:
            yield self.hosts[role]
        finally:
            self.leave(handle)


def enter_netns(path: str) -> int:
    """setns(2) the calling thread into the network namespace at `path`; returns an fd of the one it was in."""
    previous = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    target = os.open(path, os.O_RDONLY)
    try:
        _setns(target)
    except BaseException:
        os.close(previous)
        raise
    finally:
        os.close(target)
    return previous


def leave_netns(previous: int) -> None:
    try:
        _setns(previous)
    finally:
        os.close(previous)


def _in_root_netns() -> None:
    _setns(_ROOT_NETNS)


def _setns(fd: int) -> None:
    if _libc.setns(fd, CLONE_NEWNET) != 0:
        error = ctypes.get_errno()
        raise OSError(error, f"setns: {os.strerror(error)}")


def _lock_path(subnet: int) -> Path:
    return LOCK_DIR / f"grpo-lab-netns-{SUBNET_PREFIX}.{subnet}.lock"


def _claim_subnet(run_id: str) -> tuple[int, int]:
    """The first subnet no live run holds and no route uses; its lock file (held) names this run."""
    for subnet in SUBNET_RANGE:
        fd = os.open(_lock_path(subnet), os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        previous = os.read(fd, 64).decode(errors="replace").strip()
        if previous:  # a run that died before its cleanup: remove what it left
            _remove_leftovers(previous)
        if _ip("-4", "route", "show", f"{SUBNET_PREFIX}.{subnet}.0/24").stdout.strip():
            os.close(fd)  # used by something else on this machine
            continue
        os.ftruncate(fd, 0)
        os.pwrite(fd, run_id.encode(), 0)
        return subnet, fd
    raise NetnsError(f"no free subnet {SUBNET_PREFIX}.N.0/24 for N in {SUBNET_RANGE}")


def _release_subnet(fd: int) -> None:
    os.ftruncate(fd, 0)
    os.close(fd)


def _remove_leftovers(run_id: str) -> None:
    if not run_id.isalnum():
        return
    for line in _ip("-o", "link", "show", check=False).stdout.splitlines():
        name = line.split(":")[1].strip().split("@")[0] if ":" in line else ""
        if name.startswith(f"gl{run_id}v"):
            _ip("link", "del", name, check=False)
    _ip("link", "del", f"gl{run_id}br", check=False)
    for line in _ip("netns", "list", check=False).stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        if name.startswith(f"grpo-{run_id}-"):
            _ip("netns", "del", name, check=False)


# -- one network per test run, shared by the tiers that use it ------------------------------------------------------
_shared: list[Network] = []
_users = [0]
_shared_lock = threading.Lock()


@contextlib.contextmanager
def shared_network():
    """The run's network: made on first use, removed when its last user is done (also on failure). The S3 server
    and the Ray cluster share it, so a test can have both on one network."""
    with _shared_lock:
        if not _shared:
            _shared.append(Network().create())
        _users[0] += 1
        network = _shared[0]
    try:
        yield network
    finally:
        with _shared_lock:
            _users[0] -= 1
            if _users[0] == 0:
                _shared.pop().destroy()


@atexit.register
def _destroy_at_exit() -> None:  # a run that ended without its fixtures' teardown (e.g. a second Ctrl-C)
    while _shared:
        _shared.pop().destroy()


# -- a slow link ----------------------------------------------------------------------------------------------------
class DelayProxy:
    """Listens on `listen`, connects each client to `target`, and delivers every chunk `delay_ms` after it arrived,
    in both directions (a round trip costs 2 x delay_ms more). `netns`: a namespace path (`/run/netns/<name>`) the
    proxy's sockets live in. `start()` runs it on an event loop in a daemon thread; `port` is then the bound port."""

    def __init__(self, target: tuple[str, int], delay_ms: float, listen: tuple[str, int] = ("127.0.0.1", 0),
                 netns: str | None = None):
        self.target, self.delay_s, self.listen, self.netns = target, delay_ms / 1000.0, listen, netns
        self.port = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopped: asyncio.Event | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None

    def start(self, timeout: float = 10.0) -> DelayProxy:
        self._thread = threading.Thread(target=self._run, name="delay-proxy", daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout) or self._error is not None:
            raise RuntimeError(f"delay proxy did not start: {self._error!r}")
        return self

    def stop(self) -> None:
        if self._loop is not None and self._stopped is not None:
            self._loop.call_soon_threadsafe(self._stopped.set)
        if self._thread is not None:
            self._thread.join(timeout=10)

    def __enter__(self) -> DelayProxy:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def _run(self) -> None:
        try:
            if self.netns is not None:
                enter_netns(self.netns)  # this thread only, for its whole life
            asyncio.run(self._serve())
        except BaseException as error:  # reported by start()
            self._error = error
            self._ready.set()

    async def _serve(self) -> None:
        self._loop, self._stopped = asyncio.get_running_loop(), asyncio.Event()
        server = await asyncio.start_server(self._client, *self.listen)
        self.port = server.sockets[0].getsockname()[1]
        self._ready.set()
        async with server:
            await self._stopped.wait()

    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.target)
        except OSError:
            writer.close()
            return
        pipes = {asyncio.ensure_future(self._pipe(reader, up_writer)),
                 asyncio.ensure_future(self._pipe(up_reader, writer))}
        try:
            # either side ending ends both, as nginx does by default: a client that hangs up aborts its request upstream
            # (the replica then stops generating for nobody) instead of leaving it half-closed until it answers
            await asyncio.wait(pipes, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            pass  # the proxy stops: the connection ends here
        finally:
            for pipe in pipes:
                pipe.cancel()
            await asyncio.gather(*pipes, return_exceptions=True)
            for w in (writer, up_writer):
                w.close()

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Copy `reader` to `writer`, each chunk (and the end of the stream) `delay_s` late, order kept."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()

        async def deliver():
            while True:
                due, data = await queue.get()
                await asyncio.sleep(max(0.0, due - loop.time()))
                if not data:
                    if writer.can_write_eof():
                        writer.write_eof()
                    return
                writer.write(data)
                await writer.drain()

        delivering = asyncio.ensure_future(deliver())
        try:
            while True:
                data = await reader.read(65536)
                queue.put_nowait((loop.time() + self.delay_s, data))
                if not data:
                    break
            await delivering
        finally:
            delivering.cancel()


def _host_port(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host, int(port)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python tests/netns.py")
    commands = parser.add_subparsers(dest="command", required=True)
    proxy = commands.add_parser("proxy", help="a delaying TCP proxy; prints READY <port>, runs until killed")
    proxy.add_argument("--listen", type=_host_port, default=("127.0.0.1", 0), help="HOST:PORT (port 0: any free)")
    proxy.add_argument("--target", type=_host_port, required=True, help="HOST:PORT")
    proxy.add_argument("--delay-ms", type=float, required=True, help="added to each direction")
    args = parser.parse_args(argv)
    running = DelayProxy(args.target, args.delay_ms, args.listen).start()
    print(f"READY {running.port}", flush=True)
    threading.Event().wait()


if __name__ == "__main__":
    main()
