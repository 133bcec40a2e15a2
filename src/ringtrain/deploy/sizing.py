"""How big an enclave a rank needs, and how many threads: the numbers the Gramine manifest fixes.

SGX (without EDMM) fixes both when the enclave is built: ``sgx.enclave_size`` (a power of two)
and ``sgx.max_threads``. Too small and the rank dies with out-of-memory or "no thread slot"; too
large and every rank commits EPC it never uses. Both are estimates from the description, with
the terms written out so a user can see which one to raise:

* threads: OpenMP threads (the thread plan: the pod's cores shared out among its ranks), as many
  inter-op threads, ringtrain's and the process groups' own threads, the TCP mesh's two per peer
  and group (enclave ranks use ``transport = "tcp"``), and Gramine's helpers.
  ``tests/deploy/test_execute.py`` counts a real rank's threads after training and checks the
  estimate covers them.
* memory: a runtime base (the interpreter, PyTorch's CPU libraries mapped into the enclave,
  Gramine), the model's state (weights, gradients and two optimizer moments in fp32), the
  fusion buffers (sealed: a plaintext and a ciphertext copy of each), activations (batch x
  sample bytes x a factor for the layers' intermediate results), and one stack per thread;
  plus a quarter for the allocator's slack, rounded up to a power of two. The same test checks
  the base covers a real rank's peak resident memory plus the shared objects it maps.
"""

from __future__ import annotations

from dataclasses import dataclass

from ringtrain.config import Config
from ringtrain.deploy.spec import JobSpec

# Threads ringtrain and torch.distributed keep per rank, beyond compute: the controller and
# executor, the sealed backend's workers, and for each process group Gloo's loop and run-loop
# threads. A 2-rank secure job measured 19 in all with one OpenMP thread; this leaves room for
# more process groups (engine_streams, hierarchical allreduce).
RUNTIME_THREADS = 32
# An enclave rank's groups run on ringtrain's TCP mesh (transport "tcp"), which keeps two
# threads per peer in every group (one sends, one receives): a 4-rank job measured 31 threads
# per rank, 16 more than at 2 ranks. Groups counted: the default one, the world process set's
# control, cpu and engine groups, and up to one per engine stream.
MESH_BASE_GROUPS = 4
# Gramine's own threads inside the enclave: IPC, async events, a TLS handshake per pipe, and
# the main thread's slot (Gramine's manifest documentation asks for at least 4).
GRAMINE_THREADS = 4
# sys.stack.size of every enclave thread; Python's recursion needs more than Gramine's 256K.
STACK_BYTES = 2 << 20
# Python, the PyTorch CPU libraries (all mapped into enclave memory), ringtrain, Gramine's
# LibOS and PAL. Checked against a real rank's peak RSS plus its mapped shared objects.
RUNTIME_BASE_BYTES = 2 << 30
# fp32 weights, gradients and two Adam moments.
MODEL_STATE_BYTES_PER_PARAM = 16
# Intermediate results per sample, as a multiple of the input sample's size.
ACTIVATION_FACTOR = 8
SLACK = 1.25
MIN_ENCLAVE_BYTES = 1 << 30


@dataclass(frozen=True)
class EnclavePlan:
    """The numbers behind ``sgx.enclave_size`` and ``sgx.max_threads``, term by term."""

    omp_threads: int
    interop_threads: int
    mesh_threads: int
    max_threads: int
    base_bytes: int
    model_bytes: int
    fusion_bytes: int
    activation_bytes: int
    stack_bytes: int
    enclave_bytes: int

    @property
    def enclave_size(self) -> str:
        """``sgx.enclave_size`` as Gramine writes sizes (``"8G"``, ``"512M"``)."""
        gib = self.enclave_bytes >> 30
        return f"{gib}G" if gib else f"{self.enclave_bytes >> 20}M"

    def lines(self) -> list[str]:
        """The estimate explained, one term a line (for the manifest's comments and the CLI)."""
        mib = 1 << 20
        return [
            f"threads: {self.omp_threads} OpenMP + {self.interop_threads} inter-op + "
            f"{RUNTIME_THREADS} ringtrain/process groups + {self.mesh_threads} TCP mesh + "
            f"{GRAMINE_THREADS} Gramine = {self.max_threads}",
            f"memory: {self.base_bytes // mib} MiB runtime + {self.model_bytes // mib} MiB model "
            f"state + {self.fusion_bytes // mib} MiB fusion buffers + "
            f"{self.activation_bytes // mib} MiB activations + {self.stack_bytes // mib} MiB "
            f"stacks, x{SLACK}, rounded up to a power of two = {self.enclave_size}",
        ]


def plan(spec: JobSpec) -> EnclavePlan:
    """The enclave of one rank of ``spec``."""
    omp = spec.threads_per_rank
    # torch sizes its inter-op pool by the cores it sees; one rank sees its pod's cores.
    interop = spec.cpus
    config = Config.from_env({}, **dict(spec.settings))
    mesh = (MESH_BASE_GROUPS + config.engine_streams) * 2 * (spec.world_size - 1)
    max_threads = omp + interop + RUNTIME_THREADS + mesh + GRAMINE_THREADS
    model = spec.model_params * MODEL_STATE_BYTES_PER_PARAM
    # A fused bucket is at most the fusion threshold and never bigger than the gradients;
    # sealing keeps the plaintext and the ciphertext.
    bucket = config.fusion_threshold_bytes
    if spec.model_params:
        bucket = min(bucket, spec.model_params * 4)
    fusion = 2 * bucket
    activations = spec.batch_size * spec.sample_bytes * ACTIVATION_FACTOR
    stacks = max_threads * STACK_BYTES
    need = int((RUNTIME_BASE_BYTES + model + fusion + activations + stacks) * SLACK)
    size = MIN_ENCLAVE_BYTES
    while size < need:
        size *= 2
    return EnclavePlan(
        omp_threads=omp,
        interop_threads=interop,
        mesh_threads=mesh,
        max_threads=max_threads,
        base_bytes=RUNTIME_BASE_BYTES,
        model_bytes=model,
        fusion_bytes=fusion,
        activation_bytes=activations,
        stack_bytes=stacks,
        enclave_bytes=size,
    )
