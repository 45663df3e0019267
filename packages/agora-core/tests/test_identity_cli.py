"""Node keys and the ``agora`` command line."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from agora_core import identity
from agora_core.cli import main
from agora_core.identity import IdentityError, NodeKey, node_id_from_public_key, verify_signature

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"


def test_key_file_is_private_and_round_trips(tmp_path):
    key = NodeKey.generate()
    path = key.save(tmp_path / "sub" / "node.key")
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    loaded = NodeKey.load(path)
    assert loaded.node_id == key.node_id == node_id_from_public_key(key.public_key)
    assert len(key.node_id) == 40


def test_signatures_verify_only_for_the_signed_message_and_key():
    key, other = NodeKey.generate(), NodeKey.generate()
    signature = key.sign(b"stage/2/worker")
    assert verify_signature(key.public_key, b"stage/2/worker", signature)
    assert not verify_signature(key.public_key, b"stage/3/worker", signature)
    assert not verify_signature(other.public_key, b"stage/2/worker", signature)
    tampered = signature[:-1] + bytes([signature[-1] ^ 1])  # always differs (a fixed byte may not)
    assert not verify_signature(key.public_key, b"stage/2/worker", tampered)
    assert not verify_signature(b"short", b"x", signature)


def test_a_remembered_signature_still_binds_its_key_and_message(monkeypatch):
    monkeypatch.setattr(identity, "VERIFIED_CACHE_SIZE", 2)
    key, other = NodeKey.generate(), NodeKey.generate()
    messages = [b"claim/%d" % i for i in range(3)]
    signatures = [key.sign(m) for m in messages]
    for _ in range(2):  # the second pass answers from what was remembered, or checks again
        assert all(verify_signature(key.public_key, m, s) for m, s in zip(messages, signatures, strict=True))
    assert len(identity._verified) <= 2  # bounded
    assert verify_signature(key.public_key, messages[2], signatures[2])  # remembered
    assert not verify_signature(other.public_key, messages[2], signatures[2])
    assert not verify_signature(key.public_key, messages[1], signatures[2])
    assert not verify_signature(key.public_key, bytearray(messages[2]), signatures[2])  # bytes only


def test_unsafe_or_broken_key_files_are_refused(tmp_path):
    path = NodeKey.generate().save(tmp_path / "node.key")
    os.chmod(path, 0o644)
    with pytest.raises(IdentityError, match="chmod 600"):
        NodeKey.load(path)
    os.chmod(path, 0o600)
    path.write_text("something else\n")
    with pytest.raises(IdentityError, match="not an Agora key file"):
        NodeKey.load(path)
    with pytest.raises(IdentityError, match="does not exist"):
        NodeKey.load(tmp_path / "none.key")
    with pytest.raises(IdentityError, match="already exists"):
        NodeKey.generate().save(path)


def test_keygen_prints_the_node_id_of_the_file_it_wrote(tmp_path):
    runner = CliRunner()
    path = tmp_path / "node.key"
    result = runner.invoke(main, ["keygen", "--key-file", str(path)])
    assert result.exit_code == 0, result.output
    printed = result.output.split("node id:")[1].split()[0]
    assert printed == NodeKey.load(path).node_id
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    again = runner.invoke(main, ["keygen", "--key-file", str(path)])
    assert again.exit_code == 2 and "--force" in again.output
    forced = runner.invoke(main, ["keygen", "--key-file", str(path), "--force"])
    assert forced.exit_code == 0 and NodeKey.load(path).node_id != printed


def test_keygen_honours_the_environment(tmp_path):
    path = tmp_path / "env.key"
    result = CliRunner().invoke(main, ["keygen"], env={"AGORA_KEY_FILE": str(path)})
    assert result.exit_code == 0 and path.exists()


def test_config_check_summarizes_a_good_file_and_names_the_bad_key(tmp_path):
    runner = CliRunner()
    good = runner.invoke(main, ["config", "check", str(EXAMPLES / "tiny.toml")])
    assert good.exit_code == 0 and "stages     4" in good.output
    bad = tmp_path / "bad.toml"
    bad.write_text("[averaging]\nsegments = -1\n")
    result = runner.invoke(main, ["config", "check", str(bad)])
    assert result.exit_code == 2
    assert "averaging.segments" in result.output and "must be >= 1" in result.output


def test_config_check_refuses_too_few_vocabulary_rows_and_warns_of_unused_ones(tmp_path):
    runner = CliRunner()
    tiny = runner.invoke(main, ["config", "check", str(EXAMPLES / "tiny.toml")])
    assert "tokenizer  bpe: 512 ids, 512 model rows" in tiny.output and "warning" not in tiny.output
    defaults = tmp_path / "defaults.toml"
    defaults.write_text('name = "big"\n')  # bytes under the default 32000 rows
    warned = runner.invoke(main, ["config", "check", str(defaults)])
    assert warned.exit_code == 0
    assert "leaves 31744 embedding and LM-head rows that the tokenizer's 256 ids never use" in warned.output
    # A tokenizer.json is read as JSON: its ids are its vocabulary's and its added tokens'.
    tokenizer = tmp_path / "tokenizer.json"
    vocab = {f"t{i}": i for i in range(600)}
    tokenizer.write_text(
        json.dumps({"model": {"vocab": vocab}, "added_tokens": [{"id": 600, "content": "</s>"}]})
    )
    small = tmp_path / "small.toml"
    small.write_text(f'[model]\nvocab_size = 512\n[data]\ntokenizer = "{tokenizer}"\n')
    refused = runner.invoke(main, ["config", "check", str(small)])
    assert refused.exit_code == 2 and ": ok" not in refused.output
    assert "model.vocab_size: 512 is smaller than the tokenizer's 601 ids" in refused.output
    tokenizer.unlink()
    missing = runner.invoke(main, ["config", "check", str(small)])
    assert missing.exit_code == 2 and f"tokenizer file {tokenizer} does not exist" in missing.output


def test_serve_runs_a_node_that_answers_its_own_self_check():
    agora = Path(sys.executable).parent / "agora"
    result = subprocess.run(
        [str(agora), "serve", "--self-check", "--duration", "0", "--log-format", "json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert "serving    tcp://127.0.0.1:" in result.stdout
    assert "methods    echo, ping" in result.stdout
    assert "intact: True" in result.stdout
