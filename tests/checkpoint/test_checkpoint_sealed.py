"""Secure mode: checkpoint files sealed (AES-GCM) under a key derived from the job key, the
manifest authenticated. No plaintext tensor bytes on disk; a wrong key, no key or one changed
byte is a SecurityError naming the file."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

import ringtrain.checkpoint as ckpt
from ringtrain.errors import SecurityError
from ringtrain.security import keys


def _secure(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, key: bytes) -> None:
    path = keys.write_key_file(tmp_path / f"key-{key[:2].hex()}", key)
    monkeypatch.setenv("RINGTRAIN_SECURE", "1")
    monkeypatch.setenv("RINGTRAIN_KEY_FILE", path)


def _model() -> torch.nn.Module:
    model = torch.nn.Linear(64, 64)
    with torch.no_grad():  # known, distinctive values to search for
        model.weight.copy_(torch.arange(64 * 64, dtype=torch.float32).view(64, 64) * 0.001 + 3.25)
        model.bias.fill_(-7.125)
    return model


def _files(path: str) -> dict[str, bytes]:
    return {n: Path(path, n).read_bytes() for n in os.listdir(path)}


def test_sealed_round_trip_and_no_plaintext(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    key = keys.generate_job_key()
    _secure(monkeypatch, tmp_path, key)
    model = _model()
    opt = torch.optim.Adam(model.parameters())
    model(torch.ones(2, 64)).sum().backward()
    opt.step()
    path = ckpt.save(tmp_path / "ck" / "step-1", model=model, optimizer=opt, step=1)
    needles = [
        model.weight.detach().numpy().tobytes()[4096:4160],
        model.bias.detach().numpy().tobytes()[:32],
        opt.state[model.weight]["exp_avg_sq"].numpy().tobytes()[:64],
    ]
    for name, data in _files(path).items():
        for needle in needles:
            assert needle not in data, f"plaintext tensor bytes in {name}"
    fresh = torch.nn.Linear(64, 64)
    fresh_opt = torch.optim.Adam(fresh.parameters())
    ckpt.load(path, model=fresh, optimizer=fresh_opt)
    assert torch.equal(fresh.weight, model.weight) and torch.equal(fresh.bias, model.bias)

    # Another key: the manifest fails authentication.
    _secure(monkeypatch, tmp_path, keys.generate_job_key())
    with pytest.raises(SecurityError, match=r"manifest\.json failed authentication"):
        ckpt.load(path, model=fresh)
    # No key at all (not in secure mode).
    monkeypatch.delenv("RINGTRAIN_SECURE")
    monkeypatch.delenv("RINGTRAIN_KEY_FILE")
    with pytest.raises(SecurityError, match="sealed checkpoint and this job has no key"):
        ckpt.load(path, model=fresh)


@pytest.mark.parametrize("name", ["__0_0.distcp", ".metadata", "manifest.json"])
def test_one_changed_byte(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, name: str) -> None:
    _secure(monkeypatch, tmp_path, keys.generate_job_key())
    path = ckpt.save(tmp_path / "step-1", model=_model(), step=1)
    f = Path(path, name)
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0x04
    f.write_bytes(bytes(data))
    with pytest.raises(SecurityError) as err:
        ckpt.load(path, model=torch.nn.Linear(64, 64))
    assert os.path.join(path, name) in str(err.value)
