"""The names the roles of a run share: RPC methods, worker phases and stage roles.

Every role imports these (trainers without torch) instead of spelling the strings itself, so a
rename is one change and a typo is an ``AttributeError`` where it runs (and a lint error
before), not a silent mismatch on the wire. DHT keys and the values stored under them live in :mod:`agora_core.schema`.
"""

from __future__ import annotations

import enum


class Method:
    """RPC method names, grouped by the role that serves them."""

    # every DHT member (agora_core.dht)
    DHT_JOIN = "dht.join"
    DHT_PING = "dht.ping"
    DHT_PING_REQ = "dht.ping_req"
    DHT_SYNC = "dht.sync"
    DHT_MEMBERS = "dht.members"
    DHT_STORE = "dht.store"
    DHT_GET = "dht.get"
    DHT_DIGEST = "dht.digest"
    # workers: the pipeline (called by trainers)
    FORWARD = "forward"
    BACKWARD = "backward"
    FORWARD_BACKWARD = "forward_backward"  # the tail only
    # a backward's input gradient (the tail: and its losses), computed without training: what
    # a trainer's spot check asks a second replica (not the head: it returns no gradient)
    GRADIENT = "gradient"
    # workers: operators, tools and peers of the same stage
    WORKER_INFO = "worker.info"
    WORKER_PARAMETERS = "worker.parameters"
    PROGRESS_POKE = "progress.poke"
    AVERAGING_START = "averaging.start"
    AVERAGING_REDUCE = "averaging.reduce"  # a stream: chunks in, differences back
    # workers: state transfer to a joining replica (and to tools exporting the model)
    STATE_MANIFEST = "state.manifest"  # take (or reuse) a snapshot; its tensors and digests
    STATE_FETCH = "state.fetch"  # a byte range of one tensor of a snapshot
    # the authorizer (agora-authorizer): called by joining nodes and operators
    ADMISSION_JOIN = "admission.join"  # a signed join request: checked, queued or refused
    ADMISSION_POLL = "admission.poll"  # where a queued request stands; its credential once admitted
    ADMISSION_REFRESH = "admission.refresh"  # a signed refresh: the next credential, or why not
    ADMISSION_STATUS = "admission.status"  # queue, admitted per stage, refusals by reason
    # every joining node: the authorizer's dial-back (agora_core.admission.answerer)
    ADMISSION_PROVE = "admission.prove"  # sign a fresh nonce with the requesting key
    ADMISSION_PROBE = "admission.probe"  # send N random bytes (the bandwidth measurement)
    ADMISSION_CHALLENGE = "admission.challenge"  # the seeded matmul's row digests
    # `agora serve` (the transport self-check)
    PING = "ping"
    ECHO = "echo"


class Phase(enum.StrEnum):
    """Where a worker stands in joining its stage (the report's sync phases)."""

    DOWNLOADING = "downloading"  # fetching its stage's state from peers: no batches, no rounds
    SERVING = "serving"  # a full participant
    WEIGHT_SYNC = "weight_sync"  # catching up: invisible to trainers, averages at weight 0
    OPTIMIZER_SYNC = "optimizer_sync"  # serves batches, but its samples do not count

    @property
    def visible_to_trainers(self) -> bool:
        return self in (Phase.SERVING, Phase.OPTIMIZER_SYNC)

    @property
    def averages(self) -> bool:
        """Whether it takes part in averaging rounds (at weight 0 unless it counts samples)."""
        return self is not Phase.DOWNLOADING

    @property
    def counts_samples(self) -> bool:
        """Whether its samples count toward the stage's batch and weigh in averaging."""
        return self is Phase.SERVING


class StageRole(enum.StrEnum):
    """What a stage does in the pipeline, from its position."""

    HEAD = "head"  # embeds token ids; its backward returns no gradient
    BODY = "body"  # boundary in, boundary out
    TAIL = "tail"  # boundary in, loss out; trains with forward_backward

    @classmethod
    def of(cls, stage: int, n_stages: int) -> StageRole:
        if not 0 <= stage < n_stages:
            raise ValueError(f"stage {stage} does not exist: the run has stages 0..{n_stages - 1}")
        return cls.HEAD if stage == 0 else cls.TAIL if stage == n_stages - 1 else cls.BODY


class DepartureReason(enum.StrEnum):
    """Why a worker terminated itself (its self-termination rules; a monitor reads these)."""

    DEVICE_FAILURE = "device_failure"  # its compute failed request after request
    NONFINITE_GRADIENTS = "nonfinite_gradients"  # NaN or infinite gradients, step after step
    UNREACHABLE = "unreachable"  # no peer or no DHT operation succeeded for too long
    NO_PROGRESS = "no_progress"  # it held samples while its stage's step did not move
    HOST_MEMORY = "host_memory"  # its resident memory passed the limit
    AVERAGING_FAILURES = "averaging_failures"  # too many of its recent averaging rounds failed
    # its credential was refused a refresh, expired, or its node is on the revocation list
    CREDENTIAL_LOST = "credential_lost"
