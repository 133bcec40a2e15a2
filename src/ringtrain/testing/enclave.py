"""An enclave sandbox: run a rank with the system calls that Gramine lacks failing as they do there.

Gramine (SGX enclaves) has no netlink sockets (so ``getifaddrs()`` fails), no ``flock``, no
``MSG_MORE``, no ``/dev/shm``, and forking a helper process inside an enclave is not something a
rank may do. This module reproduces those limits on an ordinary Linux host with a seccomp filter
(classic BPF installed through the ``seccomp`` system call, via ctypes: no package needed) and a
private mount namespace::

    ringtrain run -np 2 --transport tcp --network-interface lo -- \\
        python -m ringtrain.testing.enclave [--strict] -- train.py ARGS...

What fails, and how (``--strict`` turns every one of them into ``SIGSYS``, killing the process,
so a test cannot miss an attempt that some library would have caught and worked around):

=====================================================  ================================
``socket(AF_NETLINK, ...)``                            ``EAFNOSUPPORT``
``flock``                                              ``ENOSYS`` (fcntl locks still work)
``sendto``/``sendmsg``/``sendmmsg`` with ``MSG_MORE``  ``EINVAL``
after ``ringtrain.init()``: ``fork``, ``vfork``,       ``EPERM``; ``clone3`` gets ``ENOSYS``
``clone`` without ``CLONE_THREAD``                     (glibc then makes threads by ``clone``)
``/dev/shm``                                           an empty read-only tmpfs: nothing can
                                                       be created there (``EROFS``)
=====================================================  ================================

The fork rule starts at ``ringtrain.init()`` (this module wraps ``ringtrain.runtime.state.start``
in the rank's process): Python and torch may spawn helpers while importing, and the contract is
about the rank once it is running. The filter is inherited by every thread and survives
``execve``; it cannot be removed. Hiding ``/dev/shm`` needs root (``CAP_SYS_ADMIN``); without it
the sandbox refuses to start unless ``--keep-dev-shm`` is given.

Linux on x86-64 and aarch64 only.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import errno
import os
import platform
import runpy
import struct
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

# ---- system call numbers and constants ----------------------------------------------------------


@dataclass(frozen=True)
class _Arch:
    audit: int  # AUDIT_ARCH_* as seccomp reports it
    seccomp: int
    socket: int
    flock: int
    sendto: int
    sendmsg: int
    sendmmsg: int
    clone: int
    clone3: int
    fork: int | None  # aarch64 has no fork/vfork system calls (glibc uses clone)
    vfork: int | None


_ARCHES = {
    "x86_64": _Arch(0xC000003E, 317, 41, 73, 44, 46, 307, 56, 435, 57, 58),
    "aarch64": _Arch(0xC00000B7, 277, 198, 32, 206, 211, 269, 220, 435, None, None),
}

AF_NETLINK = 16
MSG_MORE = 0x8000
CLONE_THREAD = 0x00010000
_X32_SYSCALL_BIT = 0x40000000

_RET_ALLOW = 0x7FFF0000
_RET_ERRNO = 0x00050000
_RET_KILL_PROCESS = 0x80000000

_PR_SET_NO_NEW_PRIVS = 38
_SECCOMP_SET_MODE_FILTER = 1
_SECCOMP_FILTER_FLAG_TSYNC = 1

# Classic BPF opcodes.
_LD_W_ABS = 0x20
_JEQ_K = 0x15
_JSET_K = 0x45
_RET_K = 0x06

# Offsets in struct seccomp_data: nr (u32), arch (u32), ip (u64), args[6] (u64 each). Only the
# low 32 bits of an argument are compared (little endian): flags and families fit in them.
_OFF_NR = 0
_OFF_ARCH = 4


def _off_arg(i: int) -> int:
    return 16 + 8 * i


class SandboxError(RuntimeError):
    """The sandbox could not be set up here (not Linux, unknown CPU, no privilege)."""


# ---- the filters, as data ----------------------------------------------------------------------


@dataclass(frozen=True)
class Rule:
    """Deny system call ``nr`` (when ``arg`` matches, if given) with ``err``."""

    nr: int
    err: int
    arg: int | None = None  # which argument to test
    equals: int | None = None  # deny when the argument's low 32 bits equal this...
    any_bit: int | None = None  # ...or have any of these bits set...
    no_bit: int | None = None  # ...or have none of these bits set
    # Not a forbidden act but a way to steer libc (clone3 -> clone): an error even when strict.
    steer: bool = False


def base_rules(arch: _Arch) -> list[Rule]:
    """What Gramine lacks from the start: netlink, flock, MSG_MORE."""
    return [
        Rule(arch.socket, errno.EAFNOSUPPORT, arg=0, equals=AF_NETLINK),
        Rule(arch.flock, errno.ENOSYS),
        Rule(arch.sendto, errno.EINVAL, arg=3, any_bit=MSG_MORE),
        Rule(arch.sendmsg, errno.EINVAL, arg=2, any_bit=MSG_MORE),
        Rule(arch.sendmmsg, errno.EINVAL, arg=3, any_bit=MSG_MORE),
    ]


def fork_rules(arch: _Arch) -> list[Rule]:
    """No new process once the rank runs; threads (``clone`` with ``CLONE_THREAD``) are fine.
    ``clone3`` passes its flags in memory, which seccomp cannot read: it gets ``ENOSYS``, and
    glibc falls back to ``clone``, whose flags the filter sees."""
    rules = [
        Rule(arch.clone, errno.EPERM, arg=0, no_bit=CLONE_THREAD),
        Rule(arch.clone3, errno.ENOSYS, steer=True),
    ]
    rules += [Rule(nr, errno.EPERM) for nr in (arch.fork, arch.vfork) if nr is not None]
    return rules


def _insn(code: int, k: int, jt: int = 0, jf: int = 0) -> bytes:
    return struct.pack("HBBI", code, jt, jf, k & 0xFFFFFFFF)


def compile_filter(arch: _Arch, rules: Sequence[Rule], strict: bool) -> bytes:
    """The BPF program: check the architecture, then each rule in turn; allow the rest.

    Each rule is a self-contained block: load nr, compare, (load arg, test), return. Blocks fall
    through to the next on no match, so no jump crosses a block (all offsets stay tiny).
    """

    def deny(rule: Rule) -> int:
        return _RET_KILL_PROCESS if strict and not rule.steer else _RET_ERRNO | rule.err

    prog = [
        _insn(_LD_W_ABS, _OFF_ARCH),
        _insn(_JEQ_K, arch.audit, jt=1, jf=0),
        _insn(_RET_K, _RET_KILL_PROCESS),  # another ABI would bypass the numbers below
        _insn(_LD_W_ABS, _OFF_NR),
        # x32 system calls (nr | 0x40000000) are another numbering: refuse them all.
        _insn(_JSET_K, _X32_SYSCALL_BIT, jt=0, jf=1),
        _insn(_RET_K, _RET_ERRNO | errno.ENOSYS),
    ]
    for rule in rules:
        block: list[bytes] = []
        if rule.arg is None:
            block += [_insn(_JEQ_K, rule.nr, jt=0, jf=1), _insn(_RET_K, deny(rule))]
        else:
            if rule.equals is not None:
                test = _insn(_JEQ_K, rule.equals, jt=0, jf=1)  # match: fall into the return
            elif rule.any_bit is not None:
                test = _insn(_JSET_K, rule.any_bit, jt=0, jf=1)
            elif rule.no_bit is not None:
                test = _insn(_JSET_K, rule.no_bit, jt=1, jf=0)  # bit set: skip the return
            else:
                raise ValueError(f"rule {rule} tests an argument but says nothing about it")
            # nr matches -> load the argument, test it, maybe deny; either way reload nr after.
            block += [
                _insn(_JEQ_K, rule.nr, jt=0, jf=4),
                _insn(_LD_W_ABS, _off_arg(rule.arg)),
                test,
                _insn(_RET_K, deny(rule)),
                _insn(_LD_W_ABS, _OFF_NR),
            ]
        prog += block
    prog.append(_insn(_RET_K, _RET_ALLOW))
    return b"".join(prog)


# ---- installing them ---------------------------------------------------------------------------


def current_arch() -> _Arch:
    if not sys.platform.startswith("linux"):
        raise SandboxError("the enclave sandbox needs Linux (seccomp)")
    machine = platform.machine()
    if machine not in _ARCHES:
        raise SandboxError(f"the enclave sandbox knows x86_64 and aarch64, not {machine}")
    return _ARCHES[machine]


def _libc() -> Any:
    return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def install(rules: Sequence[Rule], strict: bool = False) -> None:
    """Add a filter denying ``rules`` to this process (every thread, and whatever it execs)."""
    arch = current_arch()
    code = compile_filter(arch, rules, strict)
    buf = ctypes.create_string_buffer(code, len(code))
    prog = _SockFprog(len(code) // 8, ctypes.cast(buf, ctypes.c_void_p))
    libc = _libc()
    if libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        raise SandboxError(f"prctl(PR_SET_NO_NEW_PRIVS): {os.strerror(ctypes.get_errno())}")
    rc = libc.syscall(
        ctypes.c_long(arch.seccomp),
        ctypes.c_long(_SECCOMP_SET_MODE_FILTER),
        ctypes.c_long(_SECCOMP_FILTER_FLAG_TSYNC),
        ctypes.byref(prog),
    )
    if rc != 0:
        why = os.strerror(ctypes.get_errno()) if rc < 0 else f"thread {rc} could not sync"
        raise SandboxError(f"seccomp(SET_MODE_FILTER): {why}")


_CLONE_NEWNS = 0x00020000
_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_NOEXEC = 1, 2, 4, 8
_MS_REC, _MS_PRIVATE = 0x4000, 1 << 18


def hide_dev_shm() -> None:
    """Give this process a private mount namespace whose ``/dev/shm`` is an empty, read-only
    tmpfs: shm_open, POSIX semaphores and anything else that creates files there fail.
    Call while single-threaded (unshare of the mount namespace requires it)."""
    libc = _libc()
    if libc.unshare(_CLONE_NEWNS) != 0:
        raise SandboxError(
            f"unshare(CLONE_NEWNS): {os.strerror(ctypes.get_errno())} (hiding /dev/shm needs "
            "root)\nHINT: run as root, or pass --keep-dev-shm to leave /dev/shm in place."
        )
    # Mounts made below must not propagate back to the host's namespace.
    if libc.mount(b"none", b"/", None, _MS_REC | _MS_PRIVATE, None) != 0:
        raise SandboxError(f"making / private: {os.strerror(ctypes.get_errno())}")
    flags = _MS_RDONLY | _MS_NOSUID | _MS_NODEV | _MS_NOEXEC
    if libc.mount(b"tmpfs", b"/dev/shm", b"tmpfs", flags, b"size=4k,mode=000") != 0:
        raise SandboxError(f"mounting over /dev/shm: {os.strerror(ctypes.get_errno())}")


def forbid_fork_after_init(strict: bool = False) -> None:
    """Deny new processes from the moment ``ringtrain.init()`` has joined the job."""
    from ringtrain.runtime import state

    original: Callable[..., Any] = state.start
    armed = [False]

    def start(*args: Any, **kwargs: Any) -> Any:
        rt = original(*args, **kwargs)
        if not armed[0]:
            install(fork_rules(current_arch()), strict)
            armed[0] = True
        return rt

    state.start = start


def enter(strict: bool = False, keep_dev_shm: bool = False) -> None:
    """Put this process in the sandbox: /dev/shm hidden, base filter now, fork rule at init."""
    if not keep_dev_shm:
        hide_dev_shm()
    install(base_rules(current_arch()), strict)
    forbid_fork_after_init(strict)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m ringtrain.testing.enclave",
        description="Run a Python program with Gramine's missing system calls failing.",
        usage="%(prog)s [--strict] [--keep-dev-shm] [--] SCRIPT ARGS... | -m MODULE ARGS... | -c CODE",
    )
    parser.add_argument(
        "--strict",
        action="store_true",
        help="kill the process (SIGSYS) at any denied call instead of returning the error",
    )
    parser.add_argument(
        "--keep-dev-shm", action="store_true", help="leave /dev/shm as it is (no root needed)"
    )
    argv = sys.argv[1:] if argv is None else argv
    # Our options come first; everything from "--" or the first other word is the program.
    split = argv.index("--") if "--" in argv else len(argv)
    for i, word in enumerate(argv[:split]):
        if word not in ("--strict", "--keep-dev-shm", "-h", "--help"):
            split = i
            break
    args = parser.parse_args(argv[:split])
    program = argv[split + 1 :] if argv[split : split + 1] == ["--"] else argv[split:]
    if not program:
        parser.error("give the program: SCRIPT [ARGS...], -m MODULE [ARGS...] or -c CODE")
    try:
        enter(args.strict, args.keep_dev_shm)
    except SandboxError as e:
        print(f"ringtrain.testing.enclave: {e}", file=sys.stderr)
        return 2
    if program[0] == "-m" and len(program) > 1:
        sys.argv = [program[1], *program[2:]]
        runpy.run_module(program[1], run_name="__main__", alter_sys=True)
    elif program[0] == "-c" and len(program) > 1:
        sys.argv = ["-c", *program[2:]]
        exec(compile(program[1], "<string>", "exec"), {"__name__": "__main__"})
    else:
        sys.argv = list(program)
        sys.path.insert(0, os.path.dirname(os.path.abspath(program[0])))
        runpy.run_path(program[0], run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main())
