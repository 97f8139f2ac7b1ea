"""The collector is paused while a process starts (app.collector) and left as it was."""

from __future__ import annotations

import gc

import pytest

from app import collector


@pytest.mark.parametrize("enabled", [True, False])
def test_the_collector_is_paused_inside_and_restored_after(enabled):
    was = gc.isenabled()
    (gc.enable if enabled else gc.disable)()
    try:
        with collector.paused():
            assert not gc.isenabled()
        assert gc.isenabled() is enabled
    finally:
        (gc.enable if was else gc.disable)()


def test_the_collector_is_restored_when_the_block_fails():
    was = gc.isenabled()
    gc.enable()
    try:
        with pytest.raises(RuntimeError), collector.paused():
            raise RuntimeError("a failed import")
        assert gc.isenabled()
    finally:
        (gc.enable if was else gc.disable)()
