"""The enclave sandbox (:mod:`ringtrain.testing.enclave`) fails what Gramine lacks, as Gramine does.

Each check runs a real process inside the sandbox and looks at what the system calls returned
(or, with ``--strict``, that the process was killed by SIGSYS).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux") or os.geteuid() != 0,
    reason="the sandbox needs Linux seccomp and root (to hide /dev/shm)",
)

PROBE = textwrap.dedent(
    """
    import errno, fcntl, os, socket, subprocess, sys, tempfile, threading
    from ringtrain.testing import enclave

    def probe(f):
        try:
            f()
            return "ok"
        except OSError as e:
            return errno.errorcode[e.errno]

    out = {}
    out["netlink"] = probe(lambda: socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, 0).close())
    out["inet"] = probe(lambda: socket.socket(socket.AF_INET, socket.SOCK_STREAM).close())
    lock = tempfile.TemporaryFile()
    out["flock"] = probe(lambda: fcntl.flock(lock, fcntl.LOCK_EX))
    out["fcntl_lock"] = probe(lambda: fcntl.lockf(lock, fcntl.LOCK_EX))
    a, b = socket.socketpair()
    out["msg_more"] = probe(lambda: a.send(b"x", socket.MSG_MORE))
    out["sendmsg_more"] = probe(lambda: a.sendmsg([b"x"], [], socket.MSG_MORE))
    out["send"] = probe(lambda: a.send(b"x"))
    out["dev_shm"] = probe(lambda: open("/dev/shm/ringtrain-probe", "w"))
    out["fork_before"] = probe(lambda: subprocess.run(["true"], check=True))
    enclave.install(enclave.fork_rules(enclave.current_arch()))  # what init() arms
    out["fork_after"] = probe(lambda: subprocess.run(["true"], check=True))
    out["os_fork"] = probe(lambda: os._exit(0) if os.fork() == 0 else None)
    t = threading.Thread(target=lambda: None)
    t.start()
    t.join()
    out["thread_after"] = "ok"
    print(out)
    """
)


def _sandboxed(*args: str, code: str) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "ringtrain.testing.enclave", *args, "-c", code]
    return subprocess.run(argv, capture_output=True, text=True, timeout=120)


@pytest.mark.timeout(150)
def test_sandbox_fails_what_gramine_lacks() -> None:
    proc = _sandboxed(code=PROBE)
    assert proc.returncode == 0, proc.stderr
    got = eval(proc.stdout.strip().splitlines()[-1])  # our own dict literal
    assert got == {
        "netlink": "EAFNOSUPPORT",
        "inet": "ok",
        "flock": "ENOSYS",
        "fcntl_lock": "ok",
        "msg_more": "EINVAL",
        "sendmsg_more": "EINVAL",
        "send": "ok",
        "dev_shm": "EROFS",
        "fork_before": "ok",
        "fork_after": "EPERM",
        "os_fork": "EPERM",
        "thread_after": "ok",
    }
    # The host's /dev/shm is untouched: the sandbox's mount stayed in its own namespace.
    assert os.access("/dev/shm", os.W_OK)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "code",
    [
        "import socket; socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, 0)",
        "import fcntl, tempfile; fcntl.flock(tempfile.TemporaryFile(), fcntl.LOCK_EX)",
        "import socket; a, b = socket.socketpair(); a.send(b'x', socket.MSG_MORE)",
    ],
    ids=["netlink", "flock", "msg_more"],
)
def test_strict_sandbox_kills_at_the_first_attempt(code: str) -> None:
    proc = _sandboxed("--strict", code=f"print('before', flush=True); {code}; print('after')")
    assert proc.returncode == -signal.SIGSYS, (proc.returncode, proc.stderr)
    assert proc.stdout.split() == ["before"]


def test_sandbox_runs_scripts_and_modules_with_their_arguments(tmp_path: object) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "ringtrain.testing.enclave", "-m", "json.tool", "--compact"],
        input='{"a": [1, 2]}',
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == '{"a":[1,2]}'
