"""CurveZMQ on the buffer socket, over real sockets against a real `python -m buffer`: keys admit, anything else is
refused at the handshake while the service keeps serving good clients; a wide bind without keys never starts."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import zmq
from test_service import ROOT, lease_and_push, running_buffer, write_config

from asyncrl.cli import main as cli_main
from buffer.client import BufferClient, BufferUnavailable
from common import wire
from common.config import ConfigError, load_config
from common.curve import ClientKeys, client_keys, create_keys


def _refused(endpoint: str, curve: ClientKeys | None) -> bool:
    """Whether a client with these keys gets no answer at all (the handshake failed)."""
    with BufferClient(endpoint, "intruder", timeout_s=0.5, curve=curve) as client:
        try:
            client.stats()
        except BufferUnavailable:
            return True
    return False


@pytest.mark.parametrize("host", ["0.0.0.0", "127.0.0.1"])
def test_keys_admit_and_everything_else_is_refused(tmp_path: Path, host: str) -> None:
    keys_dir = tmp_path / "keys"
    create_keys(keys_dir)
    good = client_keys(str(keys_dir))
    assert good is not None
    stranger_public, stranger_secret = zmq.curve_keypair()
    with running_buffer(tmp_path, buffer={"host": host, "curve_keys_dir": str(keys_dir)}) as buffer:
        if host == "0.0.0.0":  # a wildcard bind advertises a routable address, not 0.0.0.0
            assert not buffer.endpoint.startswith("tcp://0.0.0.0:")
        lease_and_push(buffer, 1)
        assert _refused(buffer.endpoint, None)  # plain ZMQ
        assert _refused(buffer.endpoint, ClientKeys(good.public, good.secret, stranger_public))  # wrong server key
        not_allowed = ClientKeys(stranger_public, stranger_secret, good.server_public)  # right server key, unknown key
        assert _refused(buffer.endpoint, not_allowed)
        plain = zmq.Context.instance().socket(zmq.DEALER)  # a raw peer sending a valid request gets nothing either
        plain.setsockopt(zmq.LINGER, 0)
        plain.connect(buffer.endpoint)
        plain.send(wire.encode(wire.StatsRequest()))
        assert not plain.poll(500)
        plain.close()
        deadline = time.monotonic() + 10  # the good client is still served; every refused handshake is counted...
        while buffer.stats().get("rejected_handshakes", 0) < 4 and time.monotonic() < deadline:
            time.sleep(0.05)
        stats = buffer.stats()  # ...and nothing the others sent reached the loop
        assert stats["admitted_groups"] == 1 and stats["rejected_handshakes"] >= 4
        assert not any(k.startswith("rejected_") and k != "rejected_handshakes" for k in stats), stats
        lease_and_push(buffer, 1)
        assert buffer.stats()["admitted_groups"] == 2


def test_wide_bind_without_keys_never_starts(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="buffer.curve_keys_dir"):
        load_config(None, ["buffer.host=0.0.0.0"])
    # IPv6 literals (quoted for YAML): the config took them, and the buffer died with a ZMQ traceback
    for host in ("::1", "'[::1]'", "'::'"):
        with pytest.raises(ConfigError, match=r"`buffer.host=.*`: IPv6 addresses are not supported"):
            load_config(None, [f"buffer.host={host}"])
    empty = tmp_path / "empty"
    empty.mkdir()
    for buffer_section, expected in (
        ({"host": "0.0.0.0"}, "`buffer.curve_keys_dir`"),  # config validation in the service too
        ({"host": "0.0.0.0", "curve_keys_dir": str(empty)}, "server.key_secret does not exist"),
    ):
        config = write_config(tmp_path / "config.json", buffer=buffer_section)
        cmd = [sys.executable, "-m", "buffer", "--config-json", str(config), "--run-dir", str(tmp_path / "run")]
        done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=30)
        assert done.returncode == 2 and "READY" not in done.stdout, done
        assert expected in done.stderr and "buffer.curve_keys_dir" in done.stderr, done.stderr
    assert json.loads(config.read_text())["buffer"]["host"] == "0.0.0.0"


def test_keys_command_writes_private_secrets_never_overwrites(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    keys_dir = tmp_path / "keys"
    assert cli_main(["keys", str(keys_dir)]) == 0
    assert f"buffer.curve_keys_dir={keys_dir}" in capsys.readouterr().out
    for name in ("server.key_secret", "client.key_secret"):
        assert stat.S_IMODE(os.stat(keys_dir / name).st_mode) == 0o600
    assert (keys_dir / "clients" / "client.key").read_text() == (keys_dir / "client.key").read_text()
    before = (keys_dir / "server.key_secret").read_text()
    assert cli_main(["keys", str(keys_dir)]) == 2
    assert "not overwriting" in capsys.readouterr().err
    assert (keys_dir / "server.key_secret").read_text() == before


def test_keys_command_names_a_directory_it_cannot_write(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    assert cli_main(["keys", str(a_file / "keys")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"asyncrl keys: cannot write CurveZMQ keys in {a_file / 'keys'}: Not a directory (")
    assert "Errno" not in err


def test_keys_command_refuses_an_empty_name_and_never_overwrites_a_public_or_allowed_key(
    tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    assert cli_main(["keys", ""]) == 2
    assert capsys.readouterr().err == "asyncrl keys: DIR is empty: name a new directory for the keys\n"
    assert list(tmp_path.iterdir()) == []  # nothing written into the working directory
    for name in ("client.key", "clients/client.key"):
        keys_dir = tmp_path / name.replace("/", "_")
        (keys_dir / name).parent.mkdir(parents=True)
        (keys_dir / name).write_text("a key someone copied here")
        assert cli_main(["keys", str(keys_dir)]) == 2
        assert "not overwriting" in capsys.readouterr().err
        assert (keys_dir / name).read_text() == "a key someone copied here"
        assert not (keys_dir / "server.key_secret").exists()


def test_a_corrupt_key_or_a_bad_allowed_client_file_is_named_before_anything_starts(tmp_path: Path) -> None:
    from common.curve import CurveKeyError, server_keys

    keys = tmp_path / "keys"
    create_keys(keys)
    client_file = next(p for p in keys.glob("*.key_secret"))
    text = client_file.read_text()
    public = next(line.split('"')[1] for line in text.splitlines() if "public-key" in line)
    client_file.write_text(text.replace(public, "~" + public[1:]))  # '~' is not a Z85 character
    with pytest.raises(CurveKeyError, match=rf"{client_file.name} does not hold 40-character Z85"):
        client_keys(str(keys)) if "server" not in client_file.name else server_keys(str(keys))
    client_file.write_text(text)
    assert server_keys(str(keys)) is not None and client_keys(str(keys)) is not None
    stray = keys / "clients" / "stray.key"
    stray.write_text("not a certificate\n")  # pyzmq's authenticator would then admit no client at all
    with pytest.raises(CurveKeyError, match="stray.key"):
        server_keys(str(keys))
