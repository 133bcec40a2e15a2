"""The Kubernetes and Kubeflow schemas in ``tests/deploy/schema_data/`` (copied into the repository;
its README names their sources, versions and licences), as jsonschema validators.

* Core objects (``kubernetes/*.json``): "standalone-strict" JSON Schema (draft 4): every object
  has ``additionalProperties: false``, so a misspelt field is an error.
* CRDs (``kubeflow/*.yaml``): the kind's ``openAPIV3Schema`` from
  ``spec.versions[?name==version]``. The API server drops fields a structural schema does not
  declare (pruning), which hides typos; to catch them here, every object schema that lists
  ``properties`` and neither allows more (``additionalProperties``) nor keeps unknown fields
  (``x-kubernetes-preserve-unknown-fields``) is made closed. CRDs leave ``metadata`` open (the
  server checks ObjectMeta itself), so metadata is checked against the core ObjectMeta schema.
  CEL rules (``x-kubernetes-validations``) are not evaluated.
"""

from __future__ import annotations

import copy
import functools
import json
from pathlib import Path
from typing import Any

import jsonschema
import yaml

SCHEMAS = Path(__file__).resolve().parent / "schema_data"

CRDS = {
    ("kubeflow.org/v1", "PyTorchJob"): "kubeflow.org_pytorchjobs.v1.yaml",
    ("kubeflow.org/v2beta1", "MPIJob"): "kubeflow.org_mpijobs.v2beta1.yaml",
    ("trainer.kubeflow.org/v1alpha1", "TrainJob"): "trainer.kubeflow.org_trainjobs.v1alpha1.yaml",
    (
        "trainer.kubeflow.org/v1alpha1",
        "TrainingRuntime",
    ): "trainer.kubeflow.org_trainingruntimes.v1alpha1.yaml",
}
CORE = {("v1", "Secret"): "secret-v1.json", ("v1", "ConfigMap"): "configmap-v1.json"}


def _path(*parts: str) -> Path:
    path = SCHEMAS.joinpath(*parts)
    if not path.is_file():
        raise FileNotFoundError(
            f"schema {path} is missing: the deploy tests read the schemas checked in under "
            f"{SCHEMAS}.\nHINT: restore it from git (git checkout -- tests/deploy/schema_data); "
            "its README says where each file comes from."
        )
    return path


def _closed(schema: Any) -> Any:
    """``schema`` with every structural object closed to undeclared fields (see the docstring)."""
    if isinstance(schema, list):
        return [_closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _closed(v) for k, v in schema.items()}
    if (
        "properties" in out
        and "additionalProperties" not in out
        and not out.get("x-kubernetes-preserve-unknown-fields")
    ):
        out["additionalProperties"] = False
    return out


@functools.cache
def _crd_schema(file: str, version: str) -> dict[str, Any]:
    docs = [d for d in yaml.safe_load_all(_path("kubeflow", file).read_text()) if d]
    crd = next(d for d in docs if d.get("kind") == "CustomResourceDefinition")
    for v in crd["spec"]["versions"]:
        if v["name"] == version:
            return _closed(copy.deepcopy(v["schema"]["openAPIV3Schema"]))  # type: ignore[no-any-return]
    raise KeyError(f"{file} has no version {version}")


@functools.cache
def _core_schema(file: str) -> dict[str, Any]:
    return json.loads(_path("kubernetes", file).read_text())  # type: ignore[no-any-return]


def object_meta() -> dict[str, Any]:
    """Kubernetes ObjectMeta (from the core Secret schema, where it is inlined)."""
    return _core_schema("secret-v1.json")["properties"]["metadata"]  # type: ignore[no-any-return]


def errors(manifest: dict[str, Any]) -> list[str]:
    """Every schema violation of ``manifest`` as ``path: message``; empty when it is valid."""
    key = (manifest.get("apiVersion"), manifest.get("kind"))
    found: list[jsonschema.ValidationError] = []
    if key in CORE:
        schema = _core_schema(CORE[key])  # type: ignore[index]
        found += jsonschema.Draft4Validator(schema).iter_errors(manifest)
    elif key in CRDS:
        version = str(key[0]).rsplit("/", 1)[1]
        schema = _crd_schema(CRDS[key], version)  # type: ignore[index]
        found += jsonschema.Draft4Validator(schema).iter_errors(manifest)
        found += jsonschema.Draft4Validator(object_meta()).iter_errors(manifest.get("metadata"))
    else:
        raise KeyError(f"no schema for apiVersion/kind {key}")
    return [f"{'/'.join(map(str, e.absolute_path)) or '.'}: {e.message}" for e in found]
