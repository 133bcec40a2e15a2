"""The Gramine manifest template for ``--sgx``: every rank runs inside an SGX enclave.

The template is rendered and signed when the image is built (the enclave's measurement covers
it, so it cannot be changed at deploy time)::

    gramine-manifest -Dentrypoint=$(realpath $(command -v python3)) \\
        -Darch_libdir=/lib/x86_64-linux-gnu ringtrain.manifest.template ringtrain.manifest
    gramine-sgx-sign --manifest ringtrain.manifest --output ringtrain.manifest.sgx

and the pods start ranks with ``gramine-sgx ringtrain``. What it fixes, and why:

* ``loader.argv`` is the job's command: measured, so the host cannot change what runs.
* ``loader.env``: only the variables a rank needs pass through from the host: ringtrain's own
  (every ``RINGTRAIN_*`` setting), the placement variables of the launchers the generated jobs
  use (PyTorchJob and TrainJob: torchrun's and ``PET_*``; MPIJob: Open MPI's), and the
  description's ``env``. Everything else is dropped (Gramine's default).
* ``sys.enable_extra_runtime_domain_names_conf``: pods find each other by DNS name
  (``MASTER_ADDR`` is a pod name), so the enclave gets the host's resolver configuration.
* ``sgx.enclave_size`` and ``sgx.max_threads`` come from :mod:`ringtrain.deploy.sizing`.
* The job key's directory is an *allowed* (not trusted) file: it is a runtime secret, so it
  cannot be hashed at build time. The host can read it (see docs/deploy.md for attested key
  provisioning instead).
"""

from __future__ import annotations

import json
import posixpath

from ringtrain.config import Config, env_var
from ringtrain.deploy import sizing
from ringtrain.deploy.spec import JobSpec
from ringtrain.environ import PLACEMENT_VARS, Kubeflow, OpenMPI, Process, Ringtrain, Threads, Torch

MANIFEST_NAME = "ringtrain"  # gramine-sgx ringtrain -> ringtrain.manifest.sgx
TEMPLATE_FILE = f"{MANIFEST_NAME}.manifest.template"

# What the launchers of the generated jobs put in a rank's environment and ringtrain reads:
# torchrun (PyTorchJob and TrainJob pods with several ranks), the training operator (one rank
# per pod) and Open MPI (MPIJob). tests/deploy checks each target's placement survives this
# filter.
LAUNCHER_VARS = (
    Torch.MASTER_ADDR,
    Torch.MASTER_PORT,
    Torch.RANK,
    Torch.WORLD_SIZE,
    Torch.LOCAL_RANK,
    Torch.LOCAL_WORLD_SIZE,
    Torch.GROUP_RANK,
    Torch.GROUP_WORLD_SIZE,
    Torch.ROLE_RANK,
    Torch.ROLE_WORLD_SIZE,
    Torch.ROLE_NAME,
    Torch.TORCHELASTIC_RUN_ID,
    Torch.TORCHELASTIC_USE_AGENT_STORE,
    Torch.TORCHELASTIC_RESTART_COUNT,
    Torch.TORCHELASTIC_MAX_RESTARTS,
    Torch.TORCHELASTIC_ERROR_FILE,
    Kubeflow.MASTER_ADDR,
    Kubeflow.MASTER_PORT,
    Kubeflow.NNODES,
    Kubeflow.NPROC_PER_NODE,
    Kubeflow.NODE_RANK,
    OpenMPI.RANK,
    OpenMPI.SIZE,
    OpenMPI.LOCAL_RANK,
    OpenMPI.LOCAL_SIZE,
    OpenMPI.JOB_ID,
    Threads.OMP_NUM_THREADS,
    Process.PYTHONUNBUFFERED,
)
# A key pipe cannot reach into an enclave; Kubernetes jobs use the key file.
_NOT_PASSED = {Ringtrain.KEY_FD}


def passthrough_vars(spec: JobSpec) -> list[str]:
    """Every variable the manifest lets through from the host, in a stable order."""
    ringtrain = sorted(
        {env_var(f) for f in Config.__dataclass_fields__} | (set(PLACEMENT_VARS) - _NOT_PASSED)
    )
    extra = sorted(set(spec.env) - set(LAUNCHER_VARS))
    return [*ringtrain, *LAUNCHER_VARS, *extra]


def _toml(value: str) -> str:
    """``value`` as a TOML basic string that survives the template's Jinja rendering as is.

    JSON's escapes are valid TOML; other characters are written as they are (JSON's ``\\u``
    escapes of characters past U+FFFF are surrogate pairs, which TOML refuses), but for DEL,
    which TOML wants escaped and JSON does not. The template is Jinja text, so a value holding
    ``{{``, ``{%`` or ``{#`` (all begin with ``{``) would be evaluated by ``gramine-manifest``,
    and the measured argv would differ from the job's command: such a string is written as a
    Jinja expression, ``{{ "<the TOML string>" }}``, which renders the TOML string literally (a
    Jinja string literal takes Python's escapes, as JSON writes them).
    """
    text = json.dumps(value, ensure_ascii=False).replace("\x7f", "\\u007f")
    if "{" not in text:
        return text
    return "{{ " + json.dumps(text, ensure_ascii=False) + " }}"


def app_dirs(spec: JobSpec) -> list[str]:
    """Directories of the command's absolute paths (the script), mounted and trusted."""
    dirs = {posixpath.dirname(a) for a in spec.command[1:] if a.startswith("/")}
    return sorted(d for d in dirs if d not in ("", "/"))


def _for_sys_path(line: str) -> str:
    """``line`` once per directory of the entrypoint's Python ``sys.path`` (gramine-manifest's
    ``python`` helper), each on its own line."""
    return "{% for path in python.get_sys_path(entrypoint) %}" + line + "\n  {% endfor %}"


def template(spec: JobSpec, key_dir: str) -> str:
    """The manifest template (Jinja, rendered by ``gramine-manifest``) for ``spec``'s ranks."""
    p = sizing.plan(spec)
    out = [
        f"# Gramine manifest template for ringtrain job {spec.name!r}, written by",
        "# `ringtrain k8s --sgx`. Render and sign it when building the image:",
        "#   gramine-manifest -Dentrypoint=$(realpath $(command -v python3)) \\",
        f"#       -Darch_libdir=/lib/x86_64-linux-gnu {TEMPLATE_FILE} {MANIFEST_NAME}.manifest",
        f"#   gramine-sgx-sign --manifest {MANIFEST_NAME}.manifest "
        f"--output {MANIFEST_NAME}.manifest.sgx",
        f"# Pods start each rank with `gramine-sgx {MANIFEST_NAME}`.",
        "#",
        "# Enclave estimate (ringtrain.deploy.sizing):",
        *(f"#   {line}" for line in p.lines()),
        "",
        'libos.entrypoint = "{{ entrypoint }}"',
        "loader.log_level = \"{{ log_level | default('error') }}\"",
        "# The job's command, measured into the enclave: the host cannot change it.",
        "loader.argv = [" + ", ".join(_toml(a) for a in spec.command) + "]",
        'loader.env.LD_LIBRARY_PATH = "/lib:{{ arch_libdir }}:/usr/{{ arch_libdir }}"',
        'loader.env.PATH = "/usr/local/bin:/usr/bin:/bin"',
        "# Only these pass from the host: ringtrain's settings, the launchers' placement, env.",
    ]
    out += [f"loader.env.{name} = {{ passthrough = true }}" for name in passthrough_vars(spec)]
    # TOML arrays take a comma after every element, the last included.
    mounts = [
        '{ path = "/lib", uri = "file:{{ gramine.runtimedir() }}" },',
        '{ path = "{{ arch_libdir }}", uri = "file:{{ arch_libdir }}" },',
        '{ path = "/usr/{{ arch_libdir }}", uri = "file:/usr/{{ arch_libdir }}" },',
        '{ path = "{{ entrypoint }}", uri = "file:{{ entrypoint }}" },',
        '{ path = "/etc/hosts", uri = "file:/etc/hosts" },',
        '{ path = "/etc/nsswitch.conf", uri = "file:/etc/nsswitch.conf" },',
        _for_sys_path('{ path = "{{ path }}", uri = "file:{{ path }}" },'),
        *(f"{{ path = {_toml(d)}, uri = {_toml('file:' + d)} }}," for d in app_dirs(spec)),
        '{ type = "tmpfs", path = "/tmp" },',
    ]
    if spec.sealed:
        mounts.append(f"{{ path = {_toml(key_dir)}, uri = {_toml('file:' + key_dir)} }},")
    trusted = [
        '"file:{{ gramine.libos }}",',
        '"file:{{ entrypoint }}",',
        '"file:{{ gramine.runtimedir() }}/",',
        '"file:{{ arch_libdir }}/",',
        '"file:/usr/{{ arch_libdir }}/",',
        _for_sys_path(""""file:{{ path }}{{ '/' if path.is_dir() else '' }}","""),
        *(f"{_toml('file:' + d + '/')}," for d in app_dirs(spec)),
    ]
    allowed = ['"file:/etc/hosts",', '"file:/etc/nsswitch.conf",']
    if spec.sealed:
        allowed.append(f"{_toml('file:' + key_dir + '/')},")
    out += ["fs.mounts = [", *(f"  {m}" for m in mounts), "]"]
    out += [
        "",
        "# Pods reach each other by DNS name (MASTER_ADDR is a pod's name).",
        "sys.enable_extra_runtime_domain_names_conf = true",
        f'sys.stack.size = "{sizing.STACK_BYTES >> 20}M"',
        "",
        "sgx.debug = false",
        "sgx.edmm_enable = false",
        f'sgx.enclave_size = "{p.enclave_size}"',
        f"sgx.max_threads = {p.max_threads}",
        "# For attested key delivery (Gramine's secret provisioning); needs sgx.intel.com/provision.",
        'sgx.remote_attestation = "dcap"',
        "sgx.trusted_files = [",
        *(f"  {t}" for t in trusted),
        "]",
        "# Host-provided and not measurable at build time: name resolution and the job key.",
        "sgx.allowed_files = [",
        *(f"  {a}" for a in allowed),
    ]
    out += ["]", ""]
    return "\n".join(out)
