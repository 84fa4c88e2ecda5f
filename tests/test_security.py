"""Who may talk: a private socket directory, peer credentials both ways, private state.

Another user is played by a forked child that drops to ``nobody`` (a real
uid change, so the kernel reports a real foreign peer): those tests need root,
and are skipped without it; the permission checks run as anyone.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import select
import shutil
import socket
import stat
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from ipc import Codec
from ipc.messages import (
    PROTOCOL_VERSION,
    ErrorReply,
    Hello,
    ServerMessage,
    StatusReply,
    StatusRequest,
)
from supervisor.client import Client, ClientError
from supervisor.daemon.process import DaemonProcess, DaemonStartError
from supervisor.daemon.state import state_path

CODEC: Codec[ServerMessage] = Codec(ServerMessage)

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to play another user")


@pytest.fixture
def nobody() -> int:
    return pwd.getpwnam("nobody").pw_uid


@pytest.fixture
def open_dir() -> Iterator[Path]:
    """A directory under /tmp that other users can reach (pytest's are 0700)."""
    path = Path(tempfile.mkdtemp(prefix="mlx-sup-sec-"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def as_user(uid: int, work: Callable[[], bytes], timeout_s: float = 30.0) -> bytes:
    """Run ``work`` in a forked child that has become ``uid``; return its bytes."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: no return from here
        code = 0
        try:
            os.close(read_end)
            os.setgroups([])
            os.setgid(pwd.getpwuid(uid).pw_gid)
            os.setuid(uid)
            result = work()
        except BaseException as exc:
            result, code = f"ERROR {exc!r}".encode(), 1
        os.write(write_end, result)
        os._exit(code)
    os.close(write_end)
    data = b""
    try:
        while select.select([read_end], [], [], timeout_s)[0]:
            chunk = os.read(read_end, 65536)
            if not chunk:
                break
            data += chunk
    finally:
        os.close(read_end)
        os.waitpid(pid, 0)
    return data


def raw_status() -> Callable[[Path], bytes]:
    """A client that speaks the protocol by hand and returns what it was sent."""

    def talk(socket_path: Path) -> bytes:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(20)
        sock.connect(str(socket_path))
        # A refused peer may be cut off before it sends: it reads the refusal all the same.
        with contextlib.suppress(BrokenPipeError):
            sock.sendall(
                CODEC.frame(Hello(PROTOCOL_VERSION, os.getpid(), "client"))
                + CODEC.frame(StatusRequest())
            )
        data = b""
        try:
            while chunk := sock.recv(65536):
                data += chunk
        except ConnectionResetError:
            pass
        sock.close()
        return data

    return talk


def frames(data: bytes) -> list[object]:
    out: list[object] = []
    while data:
        length = int.from_bytes(data[:4], "big")
        body, data = data[4 : 4 + length], data[4 + length :]
        out.append(CODEC.decode_hello(body) if not out else CODEC.decode(body))
    return out


def start_reachable(open_dir: Path, config: str = "") -> DaemonProcess:
    """A daemon in ``open_dir/run``, then the directory and socket opened to all."""
    run = open_dir / "run"
    daemon = DaemonProcess(run / "s.sock", write_config(open_dir, config)).start()
    started_daemons.append(daemon)
    os.chmod(open_dir, 0o755)
    os.chmod(run, 0o755)
    os.chmod(run / "s.sock", 0o666)
    return daemon


def write_config(directory: Path, text: str) -> Path:
    path = directory / "config.toml"
    path.write_text(text)
    return path


started_daemons: list[DaemonProcess] = []


@pytest.fixture(autouse=True)
def stop_daemons() -> Iterator[None]:
    yield
    while started_daemons:
        daemon = started_daemons.pop()
        assert daemon.terminate() == 0


@needs_root
def test_a_foreign_uid_gets_forbidden_and_is_logged(open_dir: Path, nobody: int) -> None:
    daemon = start_reachable(open_dir)
    talk = raw_status()
    answer = frames(as_user(nobody, lambda: talk(daemon.socket_path)))
    assert isinstance(answer[0], Hello)
    reply = answer[-1]
    assert isinstance(reply, ErrorReply) and reply.code == "forbidden"
    assert f"uid {nobody}" in reply.message
    daemon.wait_until(lambda: bool(daemon.events("client_refused")), 30)  # its log line may lag
    (refusal,) = daemon.events("client_refused")
    assert refusal["peer_uid"] == nobody and isinstance(refusal["peer_pid"], int)
    assert Client(daemon.socket_path).status().runners == []  # we are still served


@needs_root
def test_allowed_uids_lets_another_user_in(open_dir: Path, nobody: int) -> None:
    daemon = start_reachable(open_dir, f"allowed_uids = [{nobody}]\n")
    talk = raw_status()
    answer = frames(as_user(nobody, lambda: talk(daemon.socket_path)))
    assert isinstance(answer[-1], StatusReply)

    owner = os.geteuid()

    def shipped_client() -> bytes:  # told to trust the daemon's uid, as a user would
        status = Client(daemon.socket_path, timeout_s=20, daemon_uid=owner).status()
        return str(status.supervisor.pid).encode()

    assert as_user(nobody, shipped_client) == str(daemon.pid).encode()
    assert not daemon.events("client_refused")


@needs_root
def test_only_the_daemons_own_user_may_inject_faults(open_dir: Path, nobody: int) -> None:
    # Fault injection makes a runner (the daemon's user) crash, hang, hold
    # memory or write files on request: another user let in by allowed_uids
    # must not have that power over the owner's processes and files.
    daemon = start_reachable(open_dir, f"allowed_uids = [{nobody}]\nhot_spare = false\n")
    owner = os.geteuid()
    target = open_dir / "written-by-a-fault"

    def inject() -> bytes:
        client = Client(daemon.socket_path, timeout_s=20, daemon_uid=owner)
        env = {"MLX_SUPERVISOR_FAULTS": f"write_at_token=1:{target}"}
        try:
            client.load("builtin:tiny", env=env)
        except ClientError as exc:
            return f"{exc.code}: {exc.message}".encode()
        return b"loaded"

    answer = as_user(nobody, inject).decode()
    assert answer.startswith("forbidden: ") and "MLX_SUPERVISOR_FAULTS" in answer
    assert Client(daemon.socket_path).status().runners == []  # nothing was started
    assert not target.exists()


@needs_root
def test_the_client_refuses_a_socket_served_by_another_uid(open_dir: Path, nobody: int) -> None:
    os.chmod(open_dir, 0o777)
    path = open_dir / "impostor.sock"
    ready_r, ready_w = os.pipe()

    def impostor() -> bytes:
        server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        server.bind(str(path))
        os.chmod(path, 0o666)
        server.listen(1)
        os.write(ready_w, b"x")
        server.settimeout(20)
        conn, _ = server.accept()
        conn.settimeout(20)
        received = b""
        while chunk := conn.recv(65536):
            received += chunk
        return str(len(received)).encode()

    result: list[bytes] = []
    pid = os.fork()
    if pid == 0:
        os.close(ready_r)
        os.setgroups([])
        os.setgid(pwd.getpwuid(nobody).pw_gid)
        os.setuid(nobody)
        try:
            out = impostor()
        except BaseException as exc:
            out = repr(exc).encode()
        os.write(ready_w, out)
        os._exit(0)
    os.close(ready_w)
    try:
        assert os.read(ready_r, 1) == b"x"
        with pytest.raises(ClientError) as excinfo:
            Client(path, timeout_s=10).status()
        assert excinfo.value.code == "forbidden" and f"uid {nobody}" in excinfo.value.message
        while chunk := os.read(ready_r, 100):
            result.append(chunk)
    finally:
        os.close(ready_r)
        os.waitpid(pid, 0)
    assert b"".join(result) == b"0"  # not one byte of our request reached it


@needs_root
def test_socket_dir_owned_by_another_user_is_refused(open_dir: Path, nobody: int) -> None:
    run = open_dir / "run"
    run.mkdir(mode=0o700)
    os.chown(run, nobody, -1)
    with pytest.raises(DaemonStartError, match=f"owned by uid {nobody}"):
        DaemonProcess(run / "s.sock").start()
    assert not (run / "s.sock").exists()


def test_socket_dir_writable_by_others_is_refused(open_dir: Path) -> None:
    run = open_dir / "run"
    run.mkdir()
    os.chmod(run, 0o777)
    with pytest.raises(DaemonStartError, match="writable by group or others"):
        DaemonProcess(run / "s.sock").start()


def test_socket_dir_is_made_0700_and_socket_0600(tmp_path: Path) -> None:
    fresh = DaemonProcess(tmp_path / "new" / "deeper" / "s.sock").start()
    try:
        assert stat.S_IMODE(os.stat(fresh.socket_path.parent).st_mode) == 0o700
        assert stat.S_IMODE(os.stat(fresh.socket_path).st_mode) == 0o600
    finally:
        assert fresh.terminate() == 0


def test_state_file_is_private(client: Client, daemon: DaemonProcess) -> None:
    client.load("builtin:tiny", env={"MLX_EXTRA": "secret"})
    path = state_path(daemon.socket_path)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(path.parent).st_mode) == 0o700
