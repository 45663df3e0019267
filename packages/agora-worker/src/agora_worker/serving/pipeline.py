"""The pipeline methods a worker serves to trainers: ``forward``, ``backward``, ``forward_backward``,
and ``gradient`` (a backward's or the tail's result computed without training, for spot checks).

A forward's reply names the weight version it ran under (meta ``version``); a trainer sends
that name back with the sample's backward, which then recomputes under the same weights while
the worker keeps them (``serving.versions``).

Each request is checked before it is queued: it must be for this worker's stage, reach a
worker trainers may use now (admitted, in an authorized run; not downloading, not in weight
sync), and carry tensors of the
shapes, dtypes and ranges its stage takes. Then it waits in the runtime's queues and is
computed in a coalesced microbatch.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from agora_core.auth.access import only
from agora_core.config.run import ModelConfig
from agora_core.contract import Method, Phase, StageRole
from agora_core.errors import BadRequest, NotServing, StageMismatch
from agora_core.injection import NO_INJECTIONS, InjectionPoints, Trigger
from agora_core.rpc import Payload, Request, RpcServer
from agora_core.wire.dtypes import Tensor
from agora_worker.serving.runtime import VERSION, Op, Runtime
from agora_worker.serving.tensors import activations, token_ids


class PipelineService:
    def __init__(
        self,
        *,
        model: ModelConfig,
        stage: int,
        role: StageRole,
        boundary_width: int,
        max_batch: int,
        runtime: Runtime,
        phase: Callable[[], Phase],
        trained: Callable[[], None],
        admitted: Callable[[], bool] = lambda: True,
        injections: InjectionPoints = NO_INJECTIONS,
    ):
        """``phase()`` is the worker's phase now; ``trained()`` is called after each backward
        landed (stage progress checks whether the stage now holds a batch); ``admitted()``
        whether it holds a valid credential of the run (always, in an open run);
        ``injections``: where the operator's forward and backward triggers fire (a request
        computed, its reply not yet sent)."""
        self._model, self._stage, self._role = model, stage, role
        self._boundary_width, self._max_batch = boundary_width, max_batch
        self._runtime, self._phase, self._trained = runtime, phase, trained
        self._admitted = admitted
        self._injections = injections
        self.refused_while_invisible = 0  # batches a trainer sent though it could not see us
        # An injected fault: the next gradient this worker returns is NaN. The worker before
        # it in the pipeline refuses it (its input check: BadRequest "holds NaN"), the trainer
        # abandons that sample, and this worker's own accumulated gradients stay clean.
        self.corrupt_next_gradient = False

    def _outgoing_gradient(self, grad: Tensor) -> Tensor:
        if self.corrupt_next_gradient:
            self.corrupt_next_gradient = False
            return np.full(grad.shape, np.nan, dtype=np.float32)  # a bf16 one is tagged words
        return grad

    def register(self, server: RpcServer) -> None:
        # In an authorized run only trainers route batches (and the operator's tools evaluate).
        access = only(("trainer", "operator"))
        server.register(Method.FORWARD, self._on_forward, access=access)
        server.register(Method.BACKWARD, self._on_backward, access=access)
        server.register(Method.FORWARD_BACKWARD, self._on_forward_backward, access=access)
        server.register(Method.GRADIENT, self._on_gradient, access=access)

    def _check(self, request: Request) -> dict:
        stage = request.meta.get("stage") if isinstance(request.meta, dict) else None
        if stage != self._stage:
            raise StageMismatch(f"request for stage {stage!r} reached a worker of stage {self._stage}")
        if not self._admitted():
            self.refused_while_invisible += 1
            raise NotServing("this worker holds no valid credential of the run (not admitted yet, or lost)")
        phase = self._phase()
        if not phase.visible_to_trainers:
            self.refused_while_invisible += 1
            raise NotServing(f"this worker is in {phase} and serves no batches yet")
        return request.tensors

    def _tokens(self, name: str, value) -> object:
        model = self._model
        return token_ids(
            name, value, vocab_size=model.vocab_size, max_batch=self._max_batch, max_len=model.seq_len
        )

    def _inputs(self, tensors: dict, *, boundary: bool, labels: bool = False, grad: bool = False) -> dict:
        tokens = self._tokens("tokens", tensors.get("tokens"))
        b, t = tokens.shape
        shape = (b, t, self._boundary_width)
        inputs = {"tokens": tokens}
        if boundary:
            inputs["boundary"] = activations("boundary", tensors.get("boundary"), shape=shape)
        if grad:
            inputs["grad"] = activations("grad", tensors.get("grad"), shape=shape)
        if labels:
            inputs["labels"] = self._tokens("labels", tensors.get("labels"))
            if inputs["labels"].shape != tokens.shape:
                raise BadRequest(f"labels must match tokens' shape {tuple(tokens.shape)}")
        return inputs

    async def _on_forward(self, request: Request) -> Payload:
        tensors = self._check(request)
        if self._role == StageRole.TAIL:
            inputs = self._inputs(tensors, boundary=True, labels=True)
            result = await self._runtime.submit(Op.EVALUATE, inputs)
            return Payload(tensors={"loss": result["loss"]})
        inputs = self._inputs(tensors, boundary=self._role != StageRole.HEAD)
        result = await self._runtime.submit(Op.FORWARD, inputs)
        if self._injections.armed:
            self._injections.reached(Trigger.FORWARD)
        return Payload(meta={VERSION: result[VERSION]}, tensors={"boundary": result["boundary"]})

    async def _on_backward(self, request: Request) -> Payload:
        tensors = self._check(request)
        if self._role == StageRole.TAIL:
            raise BadRequest("the tail trains with forward_backward, not backward")
        inputs = self._inputs(tensors, boundary=self._role != StageRole.HEAD, grad=True)
        version = request.meta.get(VERSION)  # _check: meta is a dict
        if version is not None and (not isinstance(version, int) or isinstance(version, bool) or version < 0):
            raise BadRequest("backward's version must be the int its forward's reply named")
        result = await self._runtime.submit(Op.BACKWARD, inputs, version=version)
        self._trained()
        if self._injections.armed:
            self._injections.reached(Trigger.BACKWARD)
        return Payload(tensors={"grad": self._outgoing_gradient(result["grad"])} if "grad" in result else {})

    async def _on_gradient(self, request: Request) -> Payload:
        tensors = self._check(request)
        if self._role == StageRole.HEAD:
            raise BadRequest("the head returns no input gradient: there is nothing to recompute")
        tail = self._role == StageRole.TAIL
        inputs = self._inputs(tensors, boundary=True, labels=tail, grad=not tail)
        result = await self._runtime.submit(Op.GRADIENT, inputs)
        return Payload(tensors=dict(result))

    async def _on_forward_backward(self, request: Request) -> Payload:
        tensors = self._check(request)
        if self._role != StageRole.TAIL:
            raise BadRequest(f"forward_backward is served by the tail; this worker serves the {self._role}")
        inputs = self._inputs(tensors, boundary=True, labels=True)
        result = await self._runtime.submit(Op.FORWARD_BACKWARD, inputs)
        self._trained()
        if self._injections.armed:  # the tail's one request is its forward and its backward
            self._injections.reached(Trigger.FORWARD)
            self._injections.reached(Trigger.BACKWARD)
        return Payload(tensors={"loss": result["loss"], "grad": self._outgoing_gradient(result["grad"])})
