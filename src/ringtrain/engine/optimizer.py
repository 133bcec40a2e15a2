"""DistributedOptimizer: average gradients across ranks while backward is still running.

It wraps the user's optimizer by composition. A hook on every parameter fires once the gradient
has been accumulated and submits that gradient's allreduce at once, by the parameter's name, so
communication overlaps the rest of backward; the controller fuses whatever is ready together.
``step()`` waits only for what is still in flight, then runs the wrapped optimizer.

The wrapper subclasses ``torch.optim.Optimizer`` (sharing ``param_groups`` and ``state`` with the
wrapped optimizer) only so that LR schedulers and ``isinstance`` checks accept it; it never runs
``Optimizer.__init__``.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from ringtrain.collectives import ops
from ringtrain.collectives.handles import Handle
from ringtrain.collectives.reduce_ops import resolve_op
from ringtrain.compression import resolve as resolve_compression
from ringtrain.errors import CollectiveArgumentError, ConfigError
from ringtrain.runtime.process_sets import ProcessSet


class DistributedOptimizer(torch.optim.Optimizer):
    """Horovod's ``DistributedOptimizer``: same arguments, same behaviour.

    Args:
        optimizer: the optimizer to wrap (its ``param_groups`` and ``state`` are shared).
        named_parameters: ``model.named_parameters()``; names identify each gradient's allreduce
            across ranks, so every rank must use the same names. Without them, parameters are
            named by their position in ``optimizer.param_groups``.
        compression: ``Compression.none`` (default), ``Compression.fp16``, ``.bf16``, or a name.
        backward_passes_per_step: communicate once every this many backward passes; gradients
            accumulate locally in between (as in Horovod, they are summed, not averaged: scale the
            loss by 1/k, or pass ``average_aggregated_gradients=True``, to match a k-times batch).
        op: ``Average`` (default) or ``Sum``.
        gradient_predivide_factor: divide gradients by this before the sum and by
            ``size / factor`` after it (Average only); helps keep 16-bit sums in range.
        process_set: reduce over this process set instead of the world.
        sparse_as_dense: send sparse gradients as dense tensors instead of as (indices, values).
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        named_parameters: Iterable[tuple[str, torch.nn.Parameter]] | None = None,
        compression: Any = None,
        backward_passes_per_step: int = 1,
        op: Any = None,
        gradient_predivide_factor: float = 1.0,
        process_set: ProcessSet | None = None,
        sparse_as_dense: bool = False,
        average_aggregated_gradients: bool = False,
        groups: Any = None,
    ) -> None:
        # Deliberately no super().__init__(): all optimizer state lives in the wrapped optimizer.
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise ConfigError(
                f"DistributedOptimizer wraps a torch.optim.Optimizer, got {type(optimizer).__name__}"
            )
        if isinstance(optimizer, DistributedOptimizer):
            raise ConfigError(
                "this optimizer is already a DistributedOptimizer; wrap the plain optimizer once"
            )
        if backward_passes_per_step < 1:
            raise ConfigError(
                f"backward_passes_per_step must be >= 1, got {backward_passes_per_step}"
            )
        if gradient_predivide_factor <= 0:
            raise ConfigError(
                f"gradient_predivide_factor must be > 0, got {gradient_predivide_factor}"
            )
        if groups is not None:
            warnings.warn(
                "DistributedOptimizer(groups=...) is ignored: ringtrain fuses by readiness",
                stacklevel=2,
            )
        self.optimizer = optimizer
        self._op = resolve_op(op)
        if self._op not in ("Average", "Sum"):
            raise ConfigError(f"DistributedOptimizer supports op=Average or Sum, got {self._op}")
        if gradient_predivide_factor != 1.0 and self._op != "Average":
            raise ConfigError("gradient_predivide_factor needs op=Average")
        self._compression = resolve_compression(compression)
        self._process_set = process_set
        self._controller = ops.controller_of(process_set)
        self._size = self._controller.comm.size
        self.backward_passes_per_step = backward_passes_per_step
        self._average_aggregated = average_aggregated_gradients
        self._predivide = gradient_predivide_factor
        self._sparse_as_dense = sparse_as_dense
        self._names = self._name_parameters(named_parameters)
        self._passes: dict[torch.nn.Parameter, int] = {}
        self._handles: dict[torch.nn.Parameter, tuple[Handle, Any]] = {}
        self._synchronized = False
        self._should_sync = True
        self._hooks: list[Any] = []
        self._register_hooks()

    # ---- the torch.optim.Optimizer surface, delegated ----------------------------------------

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.optimizer.param_groups = value

    @property
    def state(self) -> Any:
        return self.optimizer.state

    @state.setter
    def state(self, value: Any) -> None:
        self.optimizer.state = value

    @property
    def defaults(self) -> dict[str, Any]:
        return self.optimizer.defaults

    @defaults.setter
    def defaults(self, value: dict[str, Any]) -> None:
        self.optimizer.defaults = value

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state_dict)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self.optimizer.add_param_group(param_group)
        self._names = self._name_parameters(None, keep=self._names)
        self._register_hooks()

    def __repr__(self) -> str:
        return f"DistributedOptimizer({self.optimizer!r})"

    def __getstate__(self) -> dict[str, Any]:
        raise TypeError(
            "DistributedOptimizer cannot be pickled; save optimizer.state_dict() instead"
        )

    # ---- naming and hooks --------------------------------------------------------------------

    def _params(self) -> list[torch.nn.Parameter]:
        return [p for group in self.optimizer.param_groups for p in group["params"]]

    def _name_parameters(
        self,
        named: Iterable[tuple[str, torch.nn.Parameter]] | None,
        keep: dict[torch.nn.Parameter, str] | None = None,
    ) -> dict[torch.nn.Parameter, str]:
        params = self._params()
        if named is not None:
            pairs = list(named)
            if any(not isinstance(p, tuple) or len(p) != 2 for p in pairs):
                raise ConfigError(
                    "named_parameters must be an iterable of (name, parameter), "
                    "e.g. model.named_parameters()"
                )
            names = [n for n, _ in pairs]
            dupes = sorted({n for n in names if names.count(n) > 1})
            if dupes:
                raise ConfigError(f"named_parameters has duplicate names: {dupes}")
            by_param = {p: n for n, p in pairs}
            missing = [i for i, p in enumerate(params) if p not in by_param]
            if missing:
                raise ConfigError(
                    f"{len(missing)} optimizer parameter(s) are not in named_parameters "
                    f"(positions {missing[:5]}).\nHINT: pass the named_parameters() of the model "
                    "whose parameters the optimizer holds."
                )
            return {p: by_param[p] for p in params}
        keep = keep or {}
        return {p: keep.get(p, f"param.{i}") for i, p in enumerate(params)}

    def _register_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
        if self._size == 1:
            return  # nothing to exchange: the wrapper costs nothing at world size 1
        for p in self._params():
            if p.requires_grad:
                self._hooks.append(p.register_post_accumulate_grad_hook(self._on_grad_ready))

    def remove_hooks(self) -> None:
        """Detach from the parameters; the optimizer then behaves like the plain one."""
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def _on_grad_ready(self, p: Any) -> None:
        if not self._should_sync:
            return
        param = p  # the hook receives the parameter itself
        if param in self._handles:
            raise CollectiveArgumentError(
                f"gradient of {self._names.get(param, '?')!r} was computed again before step().\n"
                "HINT: call optimizer.step() (or synchronize()) between backward passes, or set "
                "backward_passes_per_step to the number of backward passes per step."
            )
        n = self._passes.get(param, 0) + 1
        self._passes[param] = n
        if n < self.backward_passes_per_step:
            return
        self._handles[param] = self._submit(param)

    # ---- communication -----------------------------------------------------------------------

    def _scales(self) -> tuple[str, float, float]:
        k = self.backward_passes_per_step if self._average_aggregated else 1
        if self._op == "Average":
            # Sum with explicit scales: predivide before the sum, the rest after it.
            return "Sum", 1.0 / (self._predivide * k), self._predivide / self._size
        return "Sum", 1.0 / k, 1.0

    def _submit(self, p: torch.nn.Parameter) -> tuple[Handle, Any]:
        name = f"grad.{self._names[p]}"
        grad = p.grad
        assert grad is not None
        op, pre, post = self._scales()
        if grad.is_sparse:
            if self._sparse_as_dense:
                p.grad = grad = grad.to_dense()
            else:
                return self._submit_sparse(name, grad, pre * post)
        wire, ctx = self._compression.compress(grad)
        if wire is grad:
            return ops.allreduce_async_(
                grad,
                name=name,
                op=op,
                prescale_factor=pre,
                postscale_factor=post,
                process_set=self._process_set,
            ), None
        return ops.allreduce_async_(
            wire,
            name=name,
            op=op,
            prescale_factor=pre,
            postscale_factor=post,
            process_set=self._process_set,
        ), (wire, ctx)

    def _submit_sparse(self, name: str, grad: torch.Tensor, scale: float) -> tuple[Handle, Any]:
        grad = grad.coalesce()
        indices = ops.allgather_async(
            grad.indices().t().contiguous(), f"{name}.indices", self._process_set
        )
        values = ops.allgather_async(
            grad.values().contiguous(), f"{name}.values", self._process_set
        )
        return indices, ("sparse", values, grad.shape, scale)

    def _finish(self, p: torch.nn.Parameter, handle: Handle, extra: Any) -> None:
        result = ops.synchronize(handle)
        if extra is None:
            return
        if extra[0] == "sparse":
            _, values_handle, shape, scale = extra
            values = ops.synchronize(values_handle)
            summed = torch.sparse_coo_tensor(result.t(), values * scale, shape).coalesce()
            p.grad = summed
            return
        wire, ctx = extra
        assert p.grad is not None
        p.grad.copy_(self._compression.decompress(wire, ctx))

    def synchronize(self) -> None:
        """Wait for every gradient's allreduce; parameters that got no gradient on this rank
        take part with zeros, so every rank runs the same collectives."""
        if self._size == 1:
            self._synchronized = True
            return
        for p in self._params():
            if not p.requires_grad or p in self._handles:
                continue
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            self._handles[p] = self._submit(p)
        try:
            for p, (handle, extra) in self._handles.items():
                self._finish(p, handle, extra)
        finally:
            self._handles.clear()
            self._passes.clear()
        self._synchronized = True

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """Make the next ``step()`` skip synchronization, after an explicit ``synchronize()``
        (e.g. to clip gradients on averaged values)."""
        self._synchronized = True
        try:
            yield
        finally:
            pass

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate gradients locally without communicating."""
        previous, self._should_sync = self._should_sync, False
        try:
            yield
        finally:
            self._should_sync = previous

    def step(self, closure: Callable[[], float] | None = None) -> Any:
        if self._should_sync and not self._synchronized:
            pending_passes = any(
                0 < n < self.backward_passes_per_step for n in self._passes.values()
            )
            if pending_passes:
                raise CollectiveArgumentError(
                    f"step() after {max(self._passes.values())} of {self.backward_passes_per_step} "
                    "backward passes.\nHINT: call step() once every backward_passes_per_step passes."
                )
            self.synchronize()
        self._synchronized = False
        return self.optimizer.step(closure) if closure is not None else self.optimizer.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._handles:
            raise CollectiveArgumentError(
                "optimizer.zero_grad() was called after loss.backward() but before optimizer.step() "
                "or optimizer.synchronize().\nHINT: this is usually a missing optimizer.step()."
            )
        self.optimizer.zero_grad(set_to_none=set_to_none)
