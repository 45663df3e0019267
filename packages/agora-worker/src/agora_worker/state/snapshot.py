"""A replica's stage state as named host tensors: what joiners download and checkpoints hold.

The state is every parameter of the stage module (trained weights from the optimizer's fp32
master copy, untrained ones as they are) and the AdamW moments and step count of each
trained weight, plus the optimizer's step. Names are stable across replicas and versions of
the same model (the module's parameter names), so any replica's snapshot installs into any
other's module:

    param/<name>              every parameter of the module
    adam/<name>/exp_avg       first moment   (trained weights, once a step was applied)
    adam/<name>/exp_avg_sq    second moment
    adam/<name>/step          AdamW's own step count, a float32 scalar

A snapshot is a copy: the replica goes on training while it is sent or written.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from agora_core.errors import AgoraError
from agora_worker.optimizer.host import HostOptimizer

PARAM_PREFIX = "param/"
ADAM_FIELDS = ("exp_avg", "exp_avg_sq", "step")


class StateMismatch(AgoraError):
    """A snapshot does not fit this stage: a tensor is missing, extra, or of another shape."""


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str  # numpy dtype name
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return int(np.dtype(self.dtype).itemsize * int(np.prod(self.shape, dtype=np.int64)))


@dataclass
class StateSnapshot:
    """Named host arrays of one replica's state at one optimizer step."""

    step: int  # the optimizer step the state is at
    tensors: dict[str, np.ndarray]
    _digests: dict[str, str] = field(default_factory=dict, repr=False)

    @property
    def nbytes(self) -> int:
        return sum(array.nbytes for array in self.tensors.values())

    def specs(self) -> list[TensorSpec]:
        return [TensorSpec(name, a.dtype.name, tuple(a.shape)) for name, a in self.tensors.items()]

    def digest(self, name: str) -> str:
        """SHA-256 of a tensor's bytes (C order), computed once. Slow for large tensors: call it
        off the event loop."""
        if name not in self._digests:
            self._digests[name] = tensor_digest(self.tensors[name])
        return self._digests[name]

    def digests(self) -> dict[str, str]:
        return {name: self.digest(name) for name in self.tensors}

    def only(self, prefix: str) -> StateSnapshot:
        """The tensors whose names start with ``prefix`` (e.g. ``param/``: the weights alone)."""
        kept = {n: a for n, a in self.tensors.items() if n.startswith(prefix)}
        return StateSnapshot(self.step, kept, {n: d for n, d in self._digests.items() if n in kept})


def tensor_digest(array: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(array).reshape(-1).view(np.uint8)).hexdigest()


class StageState:
    """Captures and installs the state of one replica (its module and host optimizer).

    Both run on the compute thread, under the optimizer's lock, so no step or averaging
    update lands halfway through.
    """

    def __init__(self, module: nn.Module, optimizer: HostOptimizer):
        self.module = module
        self.optimizer = optimizer
        named = list(module.named_parameters())
        trained_ids = {id(p): i for i, p in enumerate(optimizer.compute)}
        # (name, the host tensor that holds its value, its master parameter if trained)
        self._params: list[tuple[str, torch.Tensor, nn.Parameter | None]] = []
        for name, param in named:
            index = trained_ids.get(id(param))
            master = optimizer.master[index] if index is not None else None
            self._params.append((name, master if master is not None else param, master))

    def param_specs(self) -> list[TensorSpec]:
        return [
            TensorSpec(f"param/{name}", "float32", tuple(tensor.shape)) for name, tensor, _ in self._params
        ]

    def expected_specs(self) -> dict[str, TensorSpec]:
        """Every tensor a full snapshot of this stage may hold (moments are optional)."""
        specs = {s.name: s for s in self.param_specs()}
        for name, tensor, master in self._params:
            if master is None:
                continue
            for moment in ("exp_avg", "exp_avg_sq"):
                specs[f"adam/{name}/{moment}"] = TensorSpec(
                    f"adam/{name}/{moment}", "float32", tuple(tensor.shape)
                )
            specs[f"adam/{name}/step"] = TensorSpec(f"adam/{name}/step", "float32", ())
        return specs

    def capture(self, *, with_optimizer: bool = True) -> StateSnapshot:
        """A copy of the state now (compute thread)."""
        with self.optimizer.lock, torch.no_grad():
            tensors: dict[str, np.ndarray] = {}
            for name, tensor, _ in self._params:
                tensors[f"param/{name}"] = _host_copy(tensor)
            if with_optimizer:
                for name, _, master in self._params:
                    state = self.optimizer.adamw.state.get(master) if master is not None else None
                    if not state:
                        continue  # no step applied yet: AdamW creates its moments lazily
                    for moment in ADAM_FIELDS:
                        tensors[f"adam/{name}/{moment}"] = _host_copy(state[moment])
            return StateSnapshot(self.optimizer.step, tensors)

    def check(self, snapshot: StateSnapshot) -> None:
        """Raise StateMismatch unless ``snapshot`` holds every weight of this stage, each of
        its shape, and nothing this stage does not have."""
        expected = self.expected_specs()
        missing = [s.name for s in self.param_specs() if s.name not in snapshot.tensors]
        if missing:
            raise StateMismatch(f"snapshot lacks {len(missing)} weights of this stage, e.g. {missing[0]}")
        for name, array in snapshot.tensors.items():
            spec = expected.get(name)
            if spec is None:
                raise StateMismatch(f"snapshot holds {name!r}, which this stage does not have")
            if tuple(array.shape) != spec.shape:
                raise StateMismatch(f"{name}: shape {tuple(array.shape)} in the snapshot, {spec.shape} here")
        moments = {n.rsplit("/", 1)[0] for n in snapshot.tensors if n.startswith("adam/")}
        for prefix in moments:
            absent = [f for f in ADAM_FIELDS if f"{prefix}/{f}" not in snapshot.tensors]
            if absent:
                raise StateMismatch(f"{prefix}: the snapshot lacks {', '.join(absent)}")

    def install(self, snapshot: StateSnapshot) -> None:
        """Replace this replica's weights (and, where the snapshot has them, its AdamW moments)
        and step with the snapshot's (compute thread). Checks first: nothing changes on a
        mismatch."""
        self.check(snapshot)
        with self.optimizer.writing_masters():  # the compute copy follows, in one transfer
            for name, tensor, master in self._params:
                tensor.copy_(torch.from_numpy(np.ascontiguousarray(snapshot.tensors[f"param/{name}"])))
                if master is None:
                    continue
                self.optimizer.adamw.state.pop(master, None)
                if f"adam/{name}/step" in snapshot.tensors:
                    self.optimizer.adamw.state[master] = {
                        moment: torch.from_numpy(np.array(snapshot.tensors[f"adam/{name}/{moment}"]))
                        for moment in ADAM_FIELDS
                    }
            # what was accumulated belongs to the replaced weights: gradients and samples go
            self.optimizer.discard_gradients()
            self.optimizer.step = snapshot.step


def _host_copy(tensor: torch.Tensor) -> np.ndarray:
    return tensor.detach().to("cpu", torch.float32, copy=True).contiguous().numpy()
