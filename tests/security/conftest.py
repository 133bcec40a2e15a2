"""Fixtures for secure mode: a job key file the ranks can read (mode 600)."""

from __future__ import annotations

from pathlib import Path

import pytest

from ringtrain.security import keys


@pytest.fixture
def key_file(tmp_path: Path) -> str:
    """A fresh job key in a file only its owner can read."""
    return keys.write_key_file(tmp_path / "job.key", keys.generate_job_key())
