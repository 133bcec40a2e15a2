"""Progress posts to Kubeflow Trainer, which shows them in ``TrainJob.status.trainerStatus``.

Kubeflow Trainer 2.2 (feature gate ``TrainJobStatus``) injects three variables into a TrainJob's
containers (pkg/runtime/framework/plugins/trainjobstatus in kubeflow/trainer):
``KUBEFLOW_TRAINER_SERVER_URL`` (the controller's HTTPS endpoint for this TrainJob),
``KUBEFLOW_TRAINER_SERVER_CA_CERT`` (the path of the CA certificate that signs it) and
``KUBEFLOW_TRAINER_SERVER_TOKEN`` (the path of a bearer token, a JWT that rotates: read at every
post). Earlier versions of the plugin (named ``Progress``) injected the same three as
``KUBEFLOW_TRAINER_STATUS_URL``, ``..._STATUS_CA_CERT`` and ``..._STATUS_TOKEN``; those are read
where the ``SERVER`` ones are not set. Where they are set, rank 0 posts::

    {"trainerStatus": {"progressPercentage": 45, "estimatedRemainingSeconds": 120,
                       "metrics": [{"name": "steps", "value": "450"}, ...],
                       "lastUpdatedTime": "2026-11-26T22:00:00+00:00"}}

Metrics: ``steps`` (optimizer steps done), ``total_steps`` (when the script gave it, with
:func:`set_total_steps`), ``steps_per_second`` (since the previous post) and ``straggler`` (the
last verdict of the straggler report, see :mod:`ringtrain.collectives.step_timing`). Progress
and ETA are posted only when the total is known.

Posts happen on a background thread, at most one per :data:`MIN_INTERVAL_S` (Kubeflow asks
clients to throttle to about one per 5 s). The training thread only counts a step (no I/O, no
wait): an endpoint that is unreachable, slow or failing costs training nothing. Its first
failure is logged as a warning, later ones at debug level.
"""

from __future__ import annotations

import datetime
import json
import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from ringtrain.environ import KubeflowTrainer

log = logging.getLogger("ringtrain")

URL_VAR = KubeflowTrainer.SERVER_URL
CA_CERT_VAR = KubeflowTrainer.SERVER_CA_CERT
TOKEN_VAR = KubeflowTrainer.SERVER_TOKEN
# (url, CA certificate, token) variables, newest names first.
_NAMES = (
    (URL_VAR, CA_CERT_VAR, TOKEN_VAR),
    (KubeflowTrainer.STATUS_URL, KubeflowTrainer.STATUS_CA_CERT, KubeflowTrainer.STATUS_TOKEN),
)
# At most one post per this many seconds (the Kubeflow SDK throttles to the same).
MIN_INTERVAL_S = 5.0
# A post that takes longer is abandoned; the next one tries again.
POST_TIMEOUT_S = 5.0
# Trainer's API: a metric's name and value are 1 to 64 characters.
_MAX_METRIC_CHARS = 64


@dataclass(frozen=True)
class Endpoint:
    """Where to post, from the variables Kubeflow Trainer injects."""

    url: str
    ca_cert: str  # path of the CA certificate file ("" : the system's CAs)
    token: str  # path of the bearer token file ("" : no Authorization header)

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> Endpoint | None:
        for url_var, ca_var, token_var in _NAMES:
            url = env.get(url_var, "").strip()
            if url:
                return cls(url, env.get(ca_var, "").strip(), env.get(token_var, "").strip())
        return None


@dataclass(frozen=True)
class Progress:
    """One snapshot of the job, as posted."""

    steps: int
    total_steps: int | None
    steps_per_second: float | None
    straggler: str | None

    @property
    def eta_s(self) -> int | None:
        if self.total_steps is not None and self.steps >= self.total_steps:
            return 0
        if self.total_steps is None or not self.steps_per_second:
            return None
        return max(0, round((self.total_steps - self.steps) / self.steps_per_second))

    @property
    def percent(self) -> int | None:
        if not self.total_steps:
            return None
        return max(0, min(100, self.steps * 100 // self.total_steps))


def payload(p: Progress, now: datetime.datetime) -> dict[str, Any]:
    """The request body Trainer's status server decodes (``UpdateTrainJobStatusRequest``)."""
    metrics = [("steps", str(p.steps))]
    if p.total_steps is not None:
        metrics.append(("total_steps", str(p.total_steps)))
    if p.steps_per_second is not None:
        metrics.append(("steps_per_second", f"{p.steps_per_second:.4g}"))
    if p.straggler:
        metrics.append(("straggler", p.straggler))
    status: dict[str, Any] = {
        "metrics": [{"name": n, "value": v[:_MAX_METRIC_CHARS]} for n, v in metrics],
        "lastUpdatedTime": now.isoformat(timespec="seconds"),
    }
    if p.percent is not None:
        status["progressPercentage"] = p.percent
    if p.eta_s is not None:
        status["estimatedRemainingSeconds"] = p.eta_s
    return {"trainerStatus": status}


class Reporter:
    """Counts steps on the training thread; posts snapshots from its own thread.

    ``verdict``: the straggler verdict to post, or None (called on the reporter's thread).
    ``clock`` is injectable for tests.
    """

    def __init__(
        self,
        endpoint: Endpoint,
        verdict: Callable[[], str | None] = lambda: None,
        *,
        interval_s: float | None = None,
        timeout_s: float = POST_TIMEOUT_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.endpoint = endpoint
        self._verdict = verdict
        self._interval_s = MIN_INTERVAL_S if interval_s is None else interval_s
        self._timeout_s = timeout_s
        self._clock = clock
        self._lock = threading.Lock()
        self._steps = 0
        self._total: int | None = None
        self._dirty = threading.Event()
        self._stop = threading.Event()
        self._last_post = -float("inf")
        self._rate_from = (clock(), 0)  # (time, steps) where the rate's window starts
        self._rate: float | None = None
        self.posts = 0  # successful posts
        self.failures = 0
        self._thread = threading.Thread(target=self._run, name="ringtrain-trainjob-status")
        self._thread.daemon = True  # never holds the process at exit
        self._thread.start()

    def step_done(self) -> None:
        """One optimizer step finished: a count, nothing else, on the training thread."""
        with self._lock:
            self._steps += 1
        self._dirty.set()

    def set_total_steps(self, total: int | None) -> None:
        with self._lock:
            self._total = total
        self._dirty.set()

    def close(self) -> None:
        """Post the last snapshot (waiting at most the post timeout) and stop the thread."""
        self._stop.set()
        self._dirty.set()
        self._thread.join(self._timeout_s + 1.0)

    def snapshot(self) -> Progress:
        now = self._clock()
        with self._lock:
            steps, total = self._steps, self._total
        then, steps_then = self._rate_from
        if now > then and steps > steps_then:  # else the rate of the last window still holds
            self._rate = (steps - steps_then) / (now - then)
            self._rate_from = (now, steps)
        return Progress(steps, total, self._rate, self._verdict())

    def _run(self) -> None:
        while True:
            self._dirty.wait()
            if not self._stop.is_set():
                # Rate limit: wait out the interval unless asked to stop meanwhile.
                wait = self._last_post + self._interval_s - self._clock()
                if wait > 0:
                    self._stop.wait(wait)
            # Read before the snapshot: a close() that comes while this post is on its way
            # leaves _dirty set, so the loop posts once more, with the final counts.
            stopping = self._stop.is_set()
            self._dirty.clear()
            self._last_post = self._clock()
            self._post(self.snapshot())
            if stopping:
                return

    def _post(self, p: Progress) -> None:
        # Imported here, on the reporter's thread: every rank imports this module, and only a
        # TrainJob's rank 0 posts (some sandboxes, Gramine stand-ins among them, lack _ssl).
        import ssl
        import urllib.request

        try:
            body = json.dumps(payload(p, datetime.datetime.now(datetime.timezone.utc))).encode()
            headers = {"Content-Type": "application/json"}
            if self.endpoint.token:
                with open(self.endpoint.token) as f:  # re-read: the token rotates
                    headers["Authorization"] = f"Bearer {f.read().strip()}"
            context = ssl.create_default_context(cafile=self.endpoint.ca_cert or None)
            request = urllib.request.Request(self.endpoint.url, body, headers, method="POST")
            with urllib.request.urlopen(request, timeout=self._timeout_s, context=context) as r:
                r.read()
            self.posts += 1
        except Exception as e:  # reporting must never reach training
            self.failures += 1
            level = logging.WARNING if self.failures == 1 else logging.DEBUG
            log.log(
                level,
                "Kubeflow Trainer status: could not post progress to %s (%s: %s); training "
                "goes on%s",
                self.endpoint.url,
                type(e).__name__,
                e,
                ", and further failures are logged at debug level" if self.failures == 1 else "",
            )


_current: Reporter | None = None


def start(endpoint: Endpoint, verdict: Callable[[], str | None] = lambda: None) -> Reporter:
    """Start this process's reporter (rank 0's), replacing one already running."""
    global _current
    stop()
    _current = Reporter(endpoint, verdict)
    if _pending_total is not None:
        _current.set_total_steps(_pending_total)
    return _current


def stop() -> None:
    global _current
    if _current is not None:
        _current.close()
        _current = None


def current() -> Reporter | None:
    return _current


_pending_total: int | None = None


def set_total_steps(total: int | None) -> None:
    """How many optimizer steps the job will run, for the progress and ETA Kubeflow shows.

    Call it on any rank, before or after ``init()``; only rank 0 posts. None: unknown."""
    global _pending_total
    if total is not None and total < 1:
        from ringtrain.errors import ConfigError

        raise ConfigError(
            f"set_total_steps({total}): the total must be a positive number of steps, or None"
        )
    _pending_total = total
    if _current is not None:
        _current.set_total_steps(total)
