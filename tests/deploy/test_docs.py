"""docs/deploy.md shows the generator's real output: every block marked
``<!-- ringtrain k8s: WHAT -->`` must equal what the generator writes for the page's description.

To refresh the page after changing the generator: ``python tests/deploy/test_docs.py``.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import yaml

from ringtrain.deploy import gramine, manifests
from ringtrain.deploy.render import to_yaml
from ringtrain.deploy.spec import JobSpec

DOC = Path(__file__).resolve().parents[2] / "docs" / "deploy.md"
BLOCK = re.compile(
    r"<!-- ringtrain k8s: (?P<what>[\w-]+) -->\n```(?:yaml|toml)\n(?P<body>.*?)\n```", re.S
)
KEY_PLACEHOLDER = "<base64 of the job key line>"


def blocks(text: str) -> dict[str, str]:
    return {m["what"]: m["body"] for m in BLOCK.finditer(text)}


def expected(found: dict[str, str]) -> dict[str, str]:
    """What each block must hold, generated from the page's own descriptions."""
    spec = JobSpec.from_mapping(yaml.safe_load(found["description"]))
    sgx = JobSpec.from_mapping(yaml.safe_load(found["description-sgx"]))
    out = {"description": found["description"], "description-sgx": found["description-sgx"]}
    for target in ("pytorchjob", "mpijob", "trainjob"):
        out[target] = to_yaml(manifests.generate(spec, target)).rstrip("\n")
    secret = manifests.secret(spec, bytes(32))
    secret["data"] = {k: KEY_PLACEHOLDER for k in secret["data"]}
    out["secret"] = to_yaml([secret]).rstrip("\n")
    (job,) = manifests.generate(sgx, "pytorchjob")
    container = job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]
    out["sgx-container"] = to_yaml([container]).rstrip("\n")
    out["gramine"] = gramine.template(sgx, manifests.KEY_DIR).rstrip("\n")
    return out


def test_the_page_shows_what_the_generator_writes() -> None:
    found = blocks(DOC.read_text())
    want = expected(found)
    assert sorted(found) == sorted(want)
    for what, body in want.items():
        assert found[what] == body, (
            f"docs/deploy.md block {what!r} differs from the generator's output.\n"
            "HINT: python tests/deploy/test_docs.py rewrites the page's blocks."
        )


def _refresh() -> None:
    text = DOC.read_text()
    want = expected(blocks(text))

    def fill(m: re.Match[str]) -> str:
        fence = m.group(0).split("\n", 2)[1]
        return f"<!-- ringtrain k8s: {m['what']} -->\n{fence}\n{want[m['what']]}\n```"

    DOC.write_text(BLOCK.sub(fill, text))


if __name__ == "__main__":
    _refresh()
    sys.exit(0)
