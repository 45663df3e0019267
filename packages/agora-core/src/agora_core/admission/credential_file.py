"""A credential kept in a file: the operator's long-lived credentials (a DHT seed's, a
monitor's, a tool's), issued with ``agora-authorizer credential`` and given to the node with
``--credential FILE``. JSON, the signed body and signature in hex; mode 0600 like a key."""

from __future__ import annotations

import json
import os
from pathlib import Path

from agora_core.admission.credential import CredentialError, SignedCredential, verify_credential
from agora_core.admission.signed import SignedMessage
from agora_core.errors import ConfigError

FORMAT = "agora-credential-v1"


def save_credential(credential: SignedCredential, path: str | Path) -> Path:
    path = Path(path).expanduser()
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(
        {
            "format": FORMAT,
            "node_id": credential.credential.node_id,
            "role": credential.credential.role,
            "expires": credential.credential.expires,
            "body": credential.message.body.hex(),
            "signature": credential.message.signature.hex(),
        },
        indent=1,
    )
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    descriptor = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(descriptor, "w") as out:
        out.write(text + "\n")
    os.replace(tmp, path)
    return path


def load_credential(
    path: str | Path, *, authorizer_public_key: bytes, run: str, public_key: bytes
) -> SignedCredential:
    """The credential in ``path`` after checking it is the run's, for ``public_key``, and
    valid now; ConfigError saying why not."""
    path = Path(path).expanduser()
    option = "--credential"
    try:
        fields = json.loads(path.read_text())
        if fields.get("format") != FORMAT:
            raise ValueError(f"not an {FORMAT} file")
        message = SignedMessage(bytes.fromhex(fields["body"]), bytes.fromhex(fields["signature"]))
    except FileNotFoundError:
        raise ConfigError(option, f"{path} does not exist (agora-authorizer credential issues one)") from None
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ConfigError(option, f"{path} is not a credential file: {exc}") from None
    try:
        return verify_credential(
            message.to_value(), authorizer_public_key=authorizer_public_key, run=run, public_key=public_key
        )
    except CredentialError as exc:
        raise ConfigError(option, f"{path}: {exc} ({exc.reason})") from None
