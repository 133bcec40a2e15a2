"""The launcher side of a job: agents up, ranks started, output relayed, first failure acted on.

Failure policy (elastic jobs, ``--min-np``/``--max-np``: see :mod:`ringtrain.launch.elastic`): a
rank that fails is dropped and the others told to re-form the world, while at least ``--min-np``
remain; below that, or without those flags, the policy below applies.

Failure policy: the first rank that exits non-zero (or is killed by a signal) ends the job. The
others get SIGTERM, then SIGKILL after a grace period; the launcher exits with that rank's code
(128 + signal number for a signal) after a message naming the rank, its host, how it ended and
the last lines of its error output. Ctrl-C is forwarded to every rank as SIGINT; a second Ctrl-C
stops them at once. A host whose agent link breaks counts as a failure of all its ranks.
"""

from __future__ import annotations

import collections
import contextlib
import os
import queue
import secrets
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from types import FrameType
from typing import IO, Any

from ringtrain.config import horovod_settings, horovod_unused, to_env
from ringtrain.errors import LaunchError
from ringtrain.launch import elastic, network, protocol, rank_env, transport
from ringtrain.launch.hosts import Host
from ringtrain.launch.options import LaunchOptions
from ringtrain.launch.plan import ProcessSpec, describe, plan
from ringtrain.launch.rendezvous import RendezvousServer
from ringtrain.launch.tuning import HostFacts, tune

AGENT_ERR_LINES = 20


@dataclass
class Failure:
    rank: int | None
    host: str
    code: int
    description: str
    tail: list[str]


class AgentLink:
    """One host's agent process (local or ssh) and the thread that reads its messages."""

    def __init__(self, index: int, host: Host, argv: list[str], events: queue.Queue[Any]) -> None:
        self.index = index
        self.host = host
        self.argv = argv
        self.hello: dict[str, Any] | None = None
        self.done = False
        self.lost = False
        self.err_tail: collections.deque[str] = collections.deque(maxlen=AGENT_ERR_LINES)
        self.proc = subprocess.Popen(
            argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            bufsize=1,
            start_new_session=True,  # Ctrl-C goes to the launcher, which forwards it on purpose
        )
        self._events = events
        self._err_reader = threading.Thread(target=self._read_err, daemon=True)
        self._err_reader.start()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            msg = protocol.parse(line)
            if msg is not None:
                self._events.put((self, msg))
        self.proc.wait()
        # The eof report quotes err_tail (ssh's own words), so wait for stderr to drain too; a
        # grandchild holding stderr open must not hold the report up for long.
        self._err_reader.join(timeout=2.0)
        self._events.put((self, {"t": "eof"}))

    def _read_err(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.err_tail.append(line.rstrip("\n"))

    def send(self, kind: str, **fields: Any) -> None:
        if self.proc.stdin is None or self.proc.poll() is not None:
            return
        with contextlib.suppress(BrokenPipeError, OSError, ValueError):
            protocol.send(self.proc.stdin, kind, **fields)

    def close_input(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            if self.proc.stdin is not None:
                self.proc.stdin.close()

    def kill(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGKILL)


class Supervisor:
    """Runs one job to completion; :meth:`run` returns the launcher's exit code."""

    def __init__(
        self,
        options: LaunchOptions,
        env: Mapping[str, str] | None = None,
        out: IO[str] | None = None,
        err: IO[str] | None = None,
    ) -> None:
        self.options = options
        self.env = dict(os.environ if env is None else env)
        self.out = out or sys.stdout
        self.err = err or sys.stderr
        self.specs = plan(options.np, options.hosts, options.command, options.placement)
        self.job_id = uuid.uuid4().hex[:12]
        self._events: queue.Queue[Any] = queue.Queue()
        self._links: list[AgentLink] = []
        self._pids: dict[int, int] = {}
        self._exits: dict[int, dict[str, Any]] = {}
        self._failure: Failure | None = None
        self._interrupts = 0
        self._stop_deadline: float | None = None
        self._started_at = time.monotonic()
        self._outputs: dict[tuple[int, int], IO[str]] = {}
        self._server: RendezvousServer | None = None
        self._membership = (
            elastic.Membership(
                [s.rank for s in self.specs],
                options.min_np if options.min_np is not None else options.np,
            )
            if options.elastic
            else None
        )

    # ---- public ------------------------------------------------------------------------------

    def run(self) -> int:
        prior = signal.getsignal(signal.SIGINT)
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGINT, self._on_sigint)
            signal.signal(signal.SIGTERM, self._on_sigint)
        server = None
        try:
            self._log(f"job {self.job_id}: {describe(self.specs)}")
            unused = horovod_unused(self.env)
            if unused:
                self._log(
                    "accepted without effect here: "
                    + "; ".join(f"{var} ({why})" for var, why in unused)
                )
            server = RendezvousServer(
                self.options.python,
                float(self.options.settings.get("timeout_s") or 300.0),
                self.options.start_timeout_s,
            )
            self._server = server
            self._start_agents()
            self._await_hellos()
            self._start_ranks(server.chosen_port)
            self._check_server(server)
            self._supervise()
        except LaunchError as e:
            if self._failure is None and not self._interrupts:
                self._failure = Failure(None, "", 1, str(e), [])
            self._stop_all(hard=True)
        finally:
            for link in self._links:
                link.close_input()
            self._drain(deadline=time.monotonic() + self.options.grace_s + 2.0)
            for link in self._links:
                link.kill()
            if server is not None:
                server.close()
            for f in self._outputs.values():
                f.close()
            if threading.current_thread() is threading.main_thread():
                signal.signal(signal.SIGINT, prior)
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
        return self._report()

    # ---- phases ------------------------------------------------------------------------------

    def _hosts_in_use(self) -> list[Host]:
        used = {s.host for s in self.specs}
        return [h for h in self.options.hosts if h.name in used]

    def _check_server(self, server: RendezvousServer) -> None:
        if server.port != server.chosen_port:  # pragma: no cover - the server binds what it's told
            raise LaunchError(
                f"the rendezvous store bound port {server.port}, not {server.chosen_port}"
            )

    def _start_agents(self) -> None:
        cwd = os.getcwd()
        for i, host in enumerate(self._hosts_in_use()):
            argv = transport.command_for(
                host,
                self.options.ssh,
                self.options.python,
                cwd,
                self._list_interfaces(),
                network.spec_names(str(self.options.settings.get("network_interface") or "")),
            )
            self._log(f"agent on {host.name}: {' '.join(argv)}")
            try:
                self._links.append(AgentLink(i, host, argv, self._events))
            except OSError as e:
                raise LaunchError(f"cannot start the agent for host {host.name}: {e}") from e

    def _await_hellos(self) -> None:
        deadline = time.monotonic() + self.options.start_timeout_s
        while any(link.hello is None for link in self._links):
            if self._interrupts:
                raise LaunchError("interrupted while starting")
            try:
                link, msg = self._events.get(
                    timeout=max(0.0, min(0.1, deadline - time.monotonic()))
                )
            except queue.Empty:
                if time.monotonic() >= deadline:
                    missing = [lk for lk in self._links if lk.hello is None]
                    raise LaunchError(  # noqa: B904 - the timeout is the error, not Empty
                        self._unreachable(
                            missing, f"did not answer within {self.options.start_timeout_s:.0f} s"
                        )
                    )
                continue
            if msg["t"] == "hello":
                link.hello = msg
            elif msg["t"] == "eof":
                raise LaunchError(self._unreachable([link], "exited before it started"))

    def _unreachable(self, links: list[AgentLink], what: str) -> str:
        lines = []
        for lk in links:
            detail = "\n    ".join(lk.err_tail) or "(no output)"
            lines.append(f"the agent on host {lk.host.name} {what}:\n    {detail}")
        hint = (
            "HINT: check `ssh HOST true` works without a password prompt (BatchMode), that the "
            "host key is known, and that ringtrain is installed at the same path on every host; "
            "`ringtrain doctor -H ...` checks all of this."
        )
        return "\n".join([*lines, hint])

    def _start_ranks(self, port: int) -> None:
        addr, host_env = self._network()
        rdzv = rank_env.Rendezvous(addr, port, self.job_id)
        settings_env = to_env(**self.options.settings)
        key = None
        if self.options.settings.get("secure") and not self.options.settings.get("key_file"):
            key = secrets.token_bytes(32).hex()
        by_host: dict[str, list[ProcessSpec]] = {}
        for s in self.specs:
            by_host.setdefault(s.host, []).append(s)
        for link in self._links:
            specs = by_host[link.host.name]
            assert link.hello is not None
            f = link.hello["facts"]
            facts = HostFacts(
                hostname=f.get("hostname", link.host.name),
                cpus=tuple(f.get("cpus", ())),
                numa_nodes=tuple(tuple(n) for n in f.get("numa_nodes", ())),
                allocators=f.get("allocators", {}),
                cpu_quota=f.get("cpu_quota"),
            )
            base = (
                rank_env.explicit(self.env, self.options.forward_env)
                if link.host.is_local
                else rank_env.forwarded(self.env, self.options.forward_env)
            )
            tunings = tune(
                facts, len(specs), self.options.bind_to, self.options.malloc, {**self.env, **base}
            )
            ranks = []
            # The user's own GLOO_/NCCL_ interface variables win over what ringtrain chose.
            net = {
                k: v
                for k, v in host_env.get(link.host.name, {}).items()
                if k.startswith("RINGTRAIN_") or k not in self.env
            }
            for s, t in zip(specs, tunings):
                env = {**base, **settings_env, **net, **t.env}
                env.update(rank_env.placement(s, rdzv))
                if self.options.elastic:
                    env.update(
                        elastic.rank_env(
                            s.rank, self.options.elastic_timeout_s, self.options.reset_limit
                        )
                    )
                ranks.append(
                    {
                        "rank": s.rank,
                        "argv": list(s.argv),
                        "env": env,
                        "cpus": list(t.cpus) if t.cpus else None,
                    }
                )
                self._log(f"rank {s.rank} on {link.host.name}: {t.summary}")
            link.send("start", ranks=ranks, cwd=os.getcwd(), key=key, grace_s=self.options.grace_s)
        self._started_at = time.monotonic()

    def _list_interfaces(self) -> bool:
        """Secure mode or the TCP transport, with an explicit interface, enumerate nothing
        (enclaves lack netlink)."""
        return not self._enclave_ready()

    def _enclave_ready(self) -> bool:
        settings = self.options.settings
        enclave = settings.get("secure") or settings.get("transport") == "tcp"
        return bool(enclave and settings.get("network_interface"))

    def _network(self) -> tuple[str, dict[str, dict[str, str]]]:
        """The rendezvous address every host can reach, and per-host interface variables."""
        iface = str(
            self.options.settings.get("network_interface")
            or self.env.get("RINGTRAIN_NETWORK_INTERFACE", "")
            or horovod_settings(self.env).get("network_interface", "")  # HOROVOD_GLOO_IFACE
        )
        if self.options.is_local:
            return "127.0.0.1", {}
        return network.plan_network(
            {lk.host.name: lk.hello.get("interfaces", []) for lk in self._links if lk.hello},
            iface,
            secure=self._enclave_ready(),
            candidates=self.options.interface_candidates,
        )

    def _supervise(self) -> None:
        while not all(lk.done or lk.lost for lk in self._links):
            self._handle_interrupts()
            if self._stop_deadline is not None and time.monotonic() > self._stop_deadline:
                self._log("ranks did not stop in time; killing their agents")
                for lk in self._links:
                    lk.kill()
                self._stop_deadline = time.monotonic() + 5.0
            try:
                link, msg = self._events.get(timeout=0.1)
            except queue.Empty:
                continue
            self._handle(link, msg)

    def _drain(self, deadline: float) -> None:
        while not all(lk.done or lk.lost for lk in self._links) and time.monotonic() < deadline:
            try:
                link, msg = self._events.get(timeout=0.05)
            except queue.Empty:
                continue
            self._handle(link, msg)

    # ---- events ------------------------------------------------------------------------------

    def _handle(self, link: AgentLink, msg: dict[str, Any]) -> None:
        kind = msg["t"]
        if kind == "out":
            self._print_line(msg["rank"], msg["fd"], msg["line"], msg.get("end", "\n"))
        elif kind == "started":
            self._pids[msg["rank"]] = msg["pid"]
        elif kind == "exit":
            self._on_exit(link, msg)
        elif kind == "done":
            link.done = True
        elif kind == "eof" and not link.done:
            link.lost = True
            if self._failure is None and not self._interrupts:
                ranks = [s.rank for s in self.specs if s.host == link.host.name]
                desc = (
                    f"lost the connection to host {link.host.name}'s agent "
                    f"(ranks {', '.join(str(r) for r in ranks)})"
                )
                if self._membership is not None:
                    alive = [r for r in ranks if r not in self._exits]
                    if self._reform(desc, *alive):
                        return
                    desc += f"; fewer than --min-np {self._membership.min_np} ranks remain"
                self._fail(Failure(None, link.host.name, 1, desc, list(link.err_tail)))

    def _on_exit(self, link: AgentLink, msg: dict[str, Any]) -> None:
        rank = msg["rank"]
        self._exits[rank] = msg
        code, sig = msg.get("code"), msg.get("signal")
        if code == 0 and sig is None:
            return
        if self._failure is not None or self._interrupts:
            return  # stopped by us after the first failure, or by Ctrl-C
        if sig is not None:
            signum = int(signal.Signals[sig])
            how, exit_code = f"was killed by {sig}", 128 + signum
        else:
            how, exit_code = f"exited with code {code}", int(code or 1)
        pid = self._pids.get(rank)
        tail = list(msg.get("tail") or [])
        if pid is None:  # the agent could not even start the command
            desc = (
                f"rank {rank} (host {link.host.name}) could not start: {tail[-1] if tail else how}"
            )
        else:
            elapsed = time.monotonic() - self._started_at
            desc = f"rank {rank} (host {link.host.name}, pid {pid}) {how} after {elapsed:.1f} s"
        if self._membership is not None and pid is not None:
            if self._reform(desc, rank):
                return
            desc += f"; fewer than --min-np {self._membership.min_np} ranks remain"
        self._fail(Failure(rank, link.host.name, exit_code, desc, tail))

    def _reform(self, desc: str, *ranks: int) -> bool:
        """Elastic: drop ``ranks`` and announce the survivors' world. False below --min-np."""
        m = self._membership
        assert m is not None and self._server is not None
        if not m.lose(*ranks):
            return False
        for key, value in m.announcement():
            self._server.publish(key, value)
        self._say(
            f"{desc}; re-forming the world with the {len(m.members)} remaining rank(s) "
            f"{m.members} (generation {m.generation})"
        )
        return True

    def _fail(self, failure: Failure) -> None:
        self._failure = failure
        others = len(self.specs) - len([r for r in self._exits if r != failure.rank]) - 1
        self._say(f"{failure.description}; stopping the other {max(others, 0)} rank(s).")
        self._stop_all(hard=False)

    def _send_stop(self) -> None:
        for lk in self._links:
            lk.send("stop")

    def _stop_all(self, hard: bool) -> None:
        self._send_stop()
        grace = 0.0 if hard else self.options.grace_s
        self._stop_deadline = time.monotonic() + grace + 3.0

    def _on_sigint(self, signum: int, _frame: FrameType | None) -> None:
        self._interrupts += 1  # acted on by the supervising loop, not in the handler

    def _handle_interrupts(self) -> None:
        if not self._interrupts or getattr(self, "_handled_interrupts", 0) == self._interrupts:
            return
        first = not getattr(self, "_handled_interrupts", 0)
        self._handled_interrupts = self._interrupts
        if first:
            self._say("interrupted: forwarding SIGINT to every rank (again to stop at once)")
            for lk in self._links:
                lk.send("signal", sig="SIGINT")
            self._stop_deadline = time.monotonic() + self.options.grace_s + 3.0
            # Ranks that ignore SIGINT still end: the agents escalate after the grace period.
            timer = threading.Timer(self.options.grace_s, self._send_stop)
            timer.daemon = True
            timer.start()
        else:
            self._stop_all(hard=True)

    # ---- output ------------------------------------------------------------------------------

    def _print_line(self, rank: int, fd: int, line: str, end: str) -> None:
        if self.options.output_dir:
            self._output_file(rank, fd).write(line + end)
        stream = self.out if fd == 1 else self.err
        text = f"[{rank}] {line}" if self.options.prefix_output else line
        with contextlib.suppress(BrokenPipeError, ValueError):
            stream.write(text + end)
            stream.flush()

    def _output_file(self, rank: int, fd: int) -> IO[str]:
        """--output-filename DIR: DIR/rank.<rank>/stdout|stderr, as horovodrun lays them out
        (ranks zero-padded to the width of the largest, so they sort in order)."""
        f = self._outputs.get((rank, fd))
        if f is None:
            assert self.options.output_dir is not None
            width = len(str(self.options.np - 1))
            folder = os.path.join(self.options.output_dir, f"rank.{rank:0{width}d}")
            try:
                os.makedirs(folder, exist_ok=True)
                f = open(  # noqa: SIM115 (closed when the job ends)
                    os.path.join(folder, "stdout" if fd == 1 else "stderr"),
                    "w",
                    buffering=1,
                )
            except OSError as e:
                raise LaunchError(f"--output-filename: cannot write {folder}: {e}") from None
            self._outputs[(rank, fd)] = f
        return f

    def _say(self, text: str) -> None:
        with contextlib.suppress(BrokenPipeError, ValueError):
            self.err.write(f"ringtrain run: {text}\n")
            self.err.flush()

    def _log(self, text: str) -> None:
        if self.options.verbose:
            self._say(text)

    def _report(self) -> int:
        f = self._failure
        if self._interrupts and f is None:
            self._say("job interrupted")
            return 130
        if f is None:
            self._log(
                f"all {len(self.specs)} ranks exited 0 in "
                f"{time.monotonic() - self._started_at:.1f} s"
            )
            return 0
        lines = [f"job failed: {f.description}"]
        if f.tail:
            who = f"rank {f.rank}" if f.rank is not None else f"host {f.host}"
            lines.append(f"last lines of {who}'s error output:")
            lines.extend(f"  | {t}" for t in f.tail)
        self._say("\n".join(lines))
        return f.code
