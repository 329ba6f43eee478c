"""The test network the Ray tier stands on (`netns`): hosts with distinct addresses that reach each other and not the
machine's own interface, a cable that can be pulled and plugged back, a proxy that slows a link, and nothing left
behind. No Ray needed."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import netns
import psutil
import pytest

SERVER = [sys.executable, "-m", "http.server", "--bind"]
DELAY_MS = 150


@pytest.fixture
def network():
    netns.require_or_skip("the test network")
    with netns.shared_network() as network:
        yield network


def machine_addresses() -> list[str]:
    """This machine's own IPv4 interface addresses (what the hosts must not be able to dial)."""
    return [a.address for infos in psutil.net_if_addrs().values() for a in infos
            if a.family == socket.AF_INET and not a.address.startswith("127.") and
            not a.address.startswith(netns.SUBNET_PREFIX + ".")]


def serve(network, role: str) -> tuple[subprocess.Popen, str]:
    """A static HTTP server on `role`'s address, port 8080 (the host has its ports to itself); (process, URL)."""
    proc = network.popen(role, [*SERVER, network.address(role), "8080"], stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL)
    url = f"http://{network.address(role)}:8080/"
    deadline = time.monotonic() + 20
    while True:
        try:
            urllib.request.urlopen(url, timeout=1).close()
            return proc, url
        except (urllib.error.URLError, OSError):
            assert proc.poll() is None and time.monotonic() < deadline, "server did not start"
            time.sleep(0.1)


def get(url: str, timeout: float = 5.0) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout) as answer:
        return answer.read()


def test_hosts_reach_each_other_across_the_bridge_and_not_the_machine(network):
    a, b = network.add_host("t-a"), network.add_host("t-b")
    proc = None
    try:
        assert a.address != b.address and {a.address, b.address}.isdisjoint(machine_addresses())
        proc, url = serve(network, "t-b")
        assert proc.pid in {p.pid for p in psutil.process_iter()}  # `ip netns exec` execs: the PID is the server's
        with network.inside("t-a"):
            assert get(url)  # a -> b, across both cables
            for address in machine_addresses():  # no route out of the subnet: the machine is not reachable
                with socket.socket() as s:
                    s.settimeout(2)
                    assert s.connect_ex((address, 22)) != 0
        assert get(url)  # the root namespace reaches the hosts through the bridge's address
    finally:
        if proc is not None:
            proc.kill()
            proc.wait(10)
        network.remove_host("t-a")
        network.remove_host("t-b")
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert a.netns not in names and b.netns not in names
    assert subprocess.run(["ip", "link", "show", a.veth], capture_output=True).returncode != 0


def test_a_partition_drops_packets_until_healed(network):
    network.add_host("t-c")
    proc = None
    try:
        proc, url = serve(network, "t-c")
        network.partition("t-c")
        with pytest.raises((urllib.error.URLError, OSError)):  # silence (a timeout), not a refusal
            get(url, timeout=1.5)
        network.heal("t-c")
        deadline = time.monotonic() + 20
        while True:
            try:
                assert get(url)
                break
            except (urllib.error.URLError, OSError):
                assert time.monotonic() < deadline, "not reachable again after healing"
                time.sleep(0.2)
    finally:
        if proc is not None:
            proc.kill()
            proc.wait(10)
        network.remove_host("t-c")


def test_the_delay_proxy_passes_bytes_both_ways_each_late(network):
    network.add_host("t-d")
    proc = None
    try:
        proc, url = serve(network, "t-d")
        direct = get(url)
        with netns.DelayProxy((network.address("t-d"), 8080), DELAY_MS) as proxy:
            t0 = time.monotonic()
            through = get(f"http://127.0.0.1:{proxy.port}/")
            took = time.monotonic() - t0
        assert through == direct
        assert took >= 2 * DELAY_MS / 1000  # the request waited on the way in, the answer on the way out
    finally:
        if proc is not None:
            proc.kill()
            proc.wait(10)
        network.remove_host("t-d")


def test_two_networks_never_share_names_or_subnets():
    netns.require_or_skip("the test network")
    first, second = netns.Network().create(), netns.Network().create()
    try:
        assert first.subnet != second.subnet and first.bridge != second.bridge
    finally:
        first.destroy()
        second.destroy()


def test_where_namespaces_cannot_be_made_the_reason_is_given(monkeypatch):
    monkeypatch.setattr(netns.shutil, "which", lambda name: None)
    assert "no `ip` command" in netns._probe()
    monkeypatch.setattr(netns.shutil, "which", lambda name: "/usr/sbin/ip")
    monkeypatch.setattr(netns.os, "geteuid", lambda: 1000)
    assert "need root" in netns._probe()


def test_without_namespaces_the_tier_skips_or_fails_where_required(monkeypatch):
    monkeypatch.setattr(netns, "_reason", ["network namespaces need root"])
    monkeypatch.delenv(netns.REQUIRE_ENV, raising=False)
    with pytest.raises(pytest.skip.Exception, match="the Ray tier needs network namespaces: .*need root"):
        netns.require_or_skip("the Ray tier")
    monkeypatch.setenv(netns.REQUIRE_ENV, "1")  # CI
    with pytest.raises(pytest.fail.Exception, match="GRPO_LAB_REQUIRE_NETNS=1 requires them"):
        netns.require_or_skip("the Ray tier")
