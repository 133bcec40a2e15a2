"""Manifests as YAML text, and the kustomization that lists them.

PyYAML is imported only here, when text is asked for, so the generators work without it; the
``ringtrain k8s`` command needs it (``pip install 'ringtrain[k8s]'``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ringtrain.deploy.manifests import Manifest, Octal
from ringtrain.errors import ConfigError


def _yaml() -> Any:
    try:
        import yaml
    except ImportError:
        raise ConfigError(
            "writing YAML needs PyYAML, which is not installed.\n"
            "HINT: pip install 'ringtrain[k8s]' (or pip install PyYAML)."
        ) from None
    return yaml


def _dumper() -> Any:
    yaml = _yaml()

    class Dumper(yaml.SafeDumper):  # type: ignore[name-defined]
        def ignore_aliases(self, data: Any) -> bool:
            return True  # manifests are read by people: repeat a block instead of &id001

    def octal(dumper: Any, value: Octal) -> Any:
        # YAML 1.1 octal, as Kubernetes' own YAML reader takes it: 0400 is 256.
        return dumper.represent_scalar("tag:yaml.org,2002:int", f"0{int(value):o}")

    def text(dumper: Any, value: str) -> Any:
        style = "|" if "\n" in value else None
        return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)

    Dumper.add_representer(Octal, octal)
    Dumper.add_representer(str, text)
    return Dumper


def to_yaml(manifests: Sequence[Manifest]) -> str:
    """One YAML stream, a document per manifest, keys in the order they were built."""
    yaml = _yaml()
    return yaml.dump_all(
        list(manifests), Dumper=_dumper(), sort_keys=False, default_flow_style=False, width=100
    )


def kustomization(files: Sequence[str], namespace: str) -> str:
    """A ``kustomization.yaml`` listing ``files`` (``kubectl apply -k DIR``)."""
    doc = {
        "apiVersion": "kustomize.config.k8s.io/v1beta1",
        "kind": "Kustomization",
        "namespace": namespace,
        "resources": list(files),
    }
    return str(_yaml().dump(doc, Dumper=_dumper(), sort_keys=False, default_flow_style=False))
