import os
import socket

import pytest

from pdd_wire import systemd


def _receiver(address: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(address)
    sock.settimeout(5)
    return sock


@pytest.fixture
def path_socket(tmp_path, monkeypatch):
    path = str(tmp_path / "notify.sock")
    with _receiver(path) as sock:
        monkeypatch.setenv("NOTIFY_SOCKET", path)
        yield sock


@pytest.fixture
def abstract_socket(monkeypatch):
    name = f"pdd-wire-test-{os.getpid()}-{os.urandom(4).hex()}"
    with _receiver("\0" + name) as sock:
        monkeypatch.setenv("NOTIFY_SOCKET", "@" + name)
        yield sock


def test_notify_path_socket(path_socket):
    assert systemd.notify("WATCHDOG=1")
    assert path_socket.recv(4096) == b"WATCHDOG=1"


def test_notify_abstract_socket(abstract_socket):
    assert systemd.notify("READY=1")
    assert abstract_socket.recv(4096) == b"READY=1"


def test_helpers(path_socket):
    assert systemd.notify_ready()
    assert path_socket.recv(4096) == b"READY=1"
    assert systemd.notify_ready("serving site a")
    assert path_socket.recv(4096) == b"READY=1\nSTATUS=serving site a"
    assert systemd.notify_status("draining: 3 transfers")
    assert path_socket.recv(4096) == b"STATUS=draining: 3 transfers"
    assert systemd.notify_stopping()
    assert path_socket.recv(4096) == b"STOPPING=1"


def test_status_cannot_inject_assignments(path_socket):
    assert systemd.notify_status("line one\nREADY=1")
    assert path_socket.recv(4096) == b"STATUS=line one READY=1"


def test_non_ascii_status(abstract_socket):
    assert systemd.notify_status("pair ✓")
    assert abstract_socket.recv(4096) == "STATUS=pair ✓".encode()


def test_unset_returns_false(monkeypatch):
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    assert systemd.notify("READY=1") is False
    assert systemd.notify_ready("x") is False
    monkeypatch.setenv("NOTIFY_SOCKET", "")
    assert systemd.notify_stopping() is False


@pytest.mark.parametrize("value", ["relative.sock", "vsock:2:1234"])
def test_unsupported_address_returns_false(monkeypatch, value):
    monkeypatch.setenv("NOTIFY_SOCKET", value)
    assert systemd.notify("READY=1") is False


def test_missing_socket_returns_false(tmp_path, monkeypatch):
    monkeypatch.setenv("NOTIFY_SOCKET", str(tmp_path / "nobody-home.sock"))
    assert systemd.notify_ready() is False
    monkeypatch.setenv("NOTIFY_SOCKET", f"@pdd-wire-test-absent-{os.urandom(8).hex()}")
    assert systemd.notify_status("x") is False


def test_stale_socket_file_returns_false(tmp_path, monkeypatch):
    # A socket file whose receiver has exited: connect gets ECONNREFUSED.
    path = tmp_path / "stale.sock"
    _receiver(str(path)).close()
    assert path.exists()
    monkeypatch.setenv("NOTIFY_SOCKET", str(path))
    assert systemd.notify("READY=1") is False


def test_empty_state_is_not_sent(path_socket):
    assert systemd.notify("") is False
    path_socket.settimeout(0.05)
    with pytest.raises(TimeoutError):
        path_socket.recv(4096)
