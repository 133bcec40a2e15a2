"""Progress posts to Kubeflow Trainer (issue 27): a local HTTPS server on 127.0.0.1 with its own
CA, made here, stands in for Trainer's status server. It receives rank 0's posts, with the bearer
token and in Trainer 2.2's schema; an endpoint that is unreachable, failing or hanging costs
training nothing and is logged once.
"""

from __future__ import annotations

import datetime
import ipaddress
import json
import logging
import ssl
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import torch
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

import ringtrain.torch as hvd
from ringtrain.diagnostics import trainjob_status as ts
from ringtrain.diagnostics.trainjob_status import Endpoint, Progress, Reporter
from ringtrain.testing import spawn

pytestmark = pytest.mark.timeout(180)
STATUS_PATH = "/apis/trainer.kubeflow.org/v1alpha1/namespaces/ns/trainjobs/job/status"


def _cert(
    subject: str, key: ec.EllipticCurvePrivateKey, issuer: x509.Certificate | None, signer: Any
) -> x509.Certificate:
    now = datetime.datetime.now(datetime.timezone.utc)
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)])
    builder = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(issuer.subject if issuer else name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(hours=1))
    )
    if issuer is None:
        builder = builder.add_extension(x509.BasicConstraints(ca=True, path_length=None), True)
    else:
        san = x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))])
        builder = builder.add_extension(san, False)
    return builder.sign(signer, hashes.SHA256())


@dataclass
class Server:
    """Trainer's status server, as far as a client sees it."""

    url: str
    ca: str
    token: Path
    mode: str = "ok"  # "ok", "fail" (HTTP 500) or "hang" (until `release` is set)
    posts: list[dict[str, Any]] = field(default_factory=list)
    entered: threading.Event = field(default_factory=threading.Event)
    release: threading.Event = field(default_factory=threading.Event)

    def endpoint(self) -> Endpoint:
        return Endpoint(self.url, self.ca, str(self.token))

    def env(self) -> dict[str, str]:
        return {ts.URL_VAR: self.url, ts.CA_CERT_VAR: self.ca, ts.TOKEN_VAR: str(self.token)}


@pytest.fixture
def server(tmp_path: Path) -> Iterator[Server]:
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = _cert("test CA", ca_key, None, ca_key)
    key = ec.generate_private_key(ec.SECP256R1())
    cert = _cert("status server", key, ca, ca_key)
    (tmp_path / "ca.crt").write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    (tmp_path / "server.pem").write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
        + cert.public_bytes(serialization.Encoding.PEM)
    )
    (tmp_path / "token").write_text("first-token\n")
    state: Server

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers["Content-Length"]))
            state.entered.set()
            if state.mode == "hang":
                state.release.wait(60)
            state.posts.append(
                {
                    "path": self.path,
                    "auth": self.headers.get("Authorization"),
                    "type": self.headers.get("Content-Type"),
                    "body": json.loads(body),
                }
            )
            code = 500 if state.mode == "fail" else 200
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(body if code == 200 else b'{"status": "Failure"}')

        def log_message(self, *args: Any) -> None:
            pass

    class Quiet(ThreadingHTTPServer):
        def handle_error(self, request: Any, client_address: Any) -> None:
            # A client that gave up ("hang" mode: the reporter's timeout) is what is tested;
            # the late reply's broken pipe is not an error worth a traceback.
            if not isinstance(sys.exc_info()[1], ssl.SSLError | ConnectionError):
                super().handle_error(request, client_address)

    httpd = Quiet(("127.0.0.1", 0), Handler)
    httpd.daemon_threads = True
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(tmp_path / "server.pem")
    httpd.socket = context.wrap_socket(httpd.socket, server_side=True)
    url = f"https://127.0.0.1:{httpd.server_address[1]}{STATUS_PATH}"
    state = Server(url, str(tmp_path / "ca.crt"), tmp_path / "token")
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield state
    finally:
        state.release.set()
        httpd.shutdown()
        httpd.server_close()
        thread.join(10)


def _metrics(post: dict[str, Any]) -> dict[str, str]:
    return {m["name"]: m["value"] for m in post["body"]["trainerStatus"]["metrics"]}


def _status_lines(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if "Kubeflow Trainer status" in r.getMessage()]


# ---- the payload -------------------------------------------------------------------------------


def test_payload_is_trainers_schema() -> None:
    now = datetime.datetime(2026, 11, 26, 22, 0, tzinfo=datetime.timezone.utc)
    body = ts.payload(Progress(450, 1000, 10.0, "balanced"), now)
    assert body == {
        "trainerStatus": {
            "progressPercentage": 45,
            "estimatedRemainingSeconds": 55,
            "metrics": [
                {"name": "steps", "value": "450"},
                {"name": "total_steps", "value": "1000"},
                {"name": "steps_per_second", "value": "10"},
                {"name": "straggler", "value": "balanced"},
            ],
            "lastUpdatedTime": "2026-11-26T22:00:00+00:00",
        }
    }
    # unknown total: no progress nor ETA, only what is known; values fit Trainer's 64 chars
    body = ts.payload(Progress(7, None, None, "x" * 100), now)["trainerStatus"]
    assert "progressPercentage" not in body and "estimatedRemainingSeconds" not in body
    assert body["metrics"] == [
        {"name": "steps", "value": "7"},
        {"name": "straggler", "value": "x" * 64},
    ]


def test_endpoint_from_trainers_variables() -> None:
    assert Endpoint.from_env({}) is None
    env = {ts.URL_VAR: "https://c:8082/s", ts.CA_CERT_VAR: "/ca.crt", ts.TOKEN_VAR: "/token"}
    assert Endpoint.from_env(env) == Endpoint("https://c:8082/s", "/ca.crt", "/token")
    # the earlier names (the plugin's first version), read where the newer ones are not set
    old = {
        "KUBEFLOW_TRAINER_STATUS_URL": "https://o:8082/s",
        "KUBEFLOW_TRAINER_STATUS_CA_CERT": "/o.crt",
        "KUBEFLOW_TRAINER_STATUS_TOKEN": "/o-token",
    }
    assert Endpoint.from_env(old) == Endpoint("https://o:8082/s", "/o.crt", "/o-token")
    assert Endpoint.from_env({**old, **env}) == Endpoint("https://c:8082/s", "/ca.crt", "/token")


# ---- the reporter against a real HTTPS server ----------------------------------------------------


def test_posts_are_rate_limited_and_carry_the_rotating_token(server: Server) -> None:
    interval = 0.3
    reporter = Reporter(server.endpoint(), lambda: "balanced", interval_s=interval)
    reporter.set_total_steps(40)
    started = time.monotonic()
    for step in range(40):
        reporter.step_done()
        time.sleep(0.02)
        if step == 20:
            server.token.write_text("rotated-token\n")
    time.sleep(2 * interval)  # the last posts land
    reporter.close()
    elapsed = time.monotonic() - started
    assert reporter.failures == 0 and reporter.posts == len(server.posts) >= 2
    assert len(server.posts) <= elapsed / interval + 2  # at most one post per interval (+ last)
    assert {p["path"] for p in server.posts} == {STATUS_PATH}
    assert {p["type"] for p in server.posts} == {"application/json"}
    auths = [p["auth"] for p in server.posts]
    assert auths[0] == "Bearer first-token" and auths[-1] == "Bearer rotated-token"
    last = server.posts[-1]["body"]["trainerStatus"]
    assert last["progressPercentage"] == 100 and last["estimatedRemainingSeconds"] == 0
    assert _metrics(server.posts[-1])["steps"] == "40"
    assert _metrics(server.posts[-1])["straggler"] == "balanced"
    steps = [int(_metrics(p)["steps"]) for p in server.posts]
    assert steps == sorted(steps)


@pytest.mark.parametrize("how", ["unreachable", "failing", "untrusted"])
def test_a_bad_endpoint_costs_nothing_and_is_logged_once(
    server: Server, how: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    endpoint = server.endpoint()
    if how == "unreachable":
        endpoint = Endpoint("https://127.0.0.1:9/status", server.ca, str(server.token))
    elif how == "failing":
        server.mode = "fail"
    else:  # a certificate the CA file does not vouch for
        other = tmp_path / "other-ca.crt"
        key = ec.generate_private_key(ec.SECP256R1())
        other.write_bytes(_cert("other", key, None, key).public_bytes(serialization.Encoding.PEM))
        endpoint = Endpoint(server.url, str(other), str(server.token))
    caplog.set_level(logging.DEBUG, logger="ringtrain")
    reporter = Reporter(endpoint, interval_s=0.05, timeout_s=2.0)
    for _ in range(30):
        reporter.step_done()
        time.sleep(0.01)
    deadline = time.monotonic() + 30
    while reporter.failures < 3 and time.monotonic() < deadline:
        reporter.step_done()
        time.sleep(0.05)
    reporter.close()
    assert reporter.posts == 0 and reporter.failures >= 3
    lines = _status_lines(caplog)
    assert [r.levelno for r in lines].count(logging.WARNING) == 1, [r.getMessage() for r in lines]
    assert "training goes on" in lines[0].getMessage()


def test_a_hanging_endpoint_never_holds_training(server: Server) -> None:
    server.mode = "hang"
    reporter = Reporter(server.endpoint(), interval_s=0.0, timeout_s=1.0)
    reporter.step_done()
    assert server.entered.wait(30)  # the first post is stuck in the server ...
    for _ in range(1000):  # ... and steps go on regardless
        reporter.step_done()
    assert not server.release.is_set() and reporter.snapshot().steps == 1001
    reporter.close()  # bounded by the post timeout
    assert reporter.failures >= 1


# ---- rank 0 of a real job ------------------------------------------------------------------------


def _train(steps: int) -> int:
    ts.MIN_INTERVAL_S = 0.1
    ts.set_total_steps(steps)
    hvd.init(straggler_report_steps=3)
    try:
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 1)
        opt = hvd.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters()
        )
        for _ in range(steps):
            opt.zero_grad()
            model(torch.randn(8, 4)).pow(2).mean().backward()
            opt.step()
        return int(ts.current() is not None)
    finally:
        hvd.shutdown()
        ts.set_total_steps(None)


def test_rank_0_of_a_job_posts_its_progress(server: Server) -> None:
    world = spawn.world(2)
    reporting = world.run(_train, 6, env=server.env(), init=False, timeout=120)
    assert reporting == [1, 0]  # rank 0 only
    assert server.posts and {p["auth"] for p in server.posts} == {"Bearer first-token"}
    last = server.posts[-1]["body"]["trainerStatus"]
    assert last["progressPercentage"] == 100
    metrics = _metrics(server.posts[-1])
    assert metrics["steps"] == "6" and metrics["total_steps"] == "6"
    assert "straggler" in metrics  # the verdict of the report at step 6
