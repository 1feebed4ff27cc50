"""Multi-device tests: eight forced host CPU devices, in their own pytest process.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m pytest tests/multidevice

(tests/run_all.py does this.)  The flag must be set before jax is imported, so these tests cannot
share a process with the single-device suite."""

from __future__ import annotations

import os
from pathlib import Path

import jax
import pytest

ROOT = Path(__file__).resolve().parents[2]
MODEL_DIR = Path(os.environ.get("XLASERVE_MODEL_DIR", ROOT / ".models" / "smollm2-135m-instruct"))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        item.add_marker(pytest.mark.multidevice)


@pytest.fixture(scope="session", autouse=True)
def eight_devices() -> None:
    if jax.device_count() < 8:
        pytest.fail(f"multi-device tests need 8 devices, found {jax.device_count()}: run them "
                    f"with XLA_FLAGS=--xla_force_host_platform_device_count=8 in their own "
                    f"process (tests/run_all.py does)")


@pytest.fixture(scope="session")
def model_dir() -> Path:
    if not (MODEL_DIR / "config.json").exists():
        pytest.fail(f"{MODEL_DIR} is not converted: run `make model` or set XLASERVE_MODEL_DIR")
    return MODEL_DIR
