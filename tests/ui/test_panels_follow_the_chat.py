"""The panels follow the chat on screen: a new chat, or another conversation opened, clears
them; the roofline dock shows what a real engine counted."""

from __future__ import annotations

from tests.ui.test_assembled_window import send_and_wait, show_attention


def test_new_chat_clears_the_panels(qtbot, build, tiny_loader):
    parts = build(tiny_loader)
    show_attention(qtbot, parts)
    send_and_wait(qtbot, parts, "Hello there")
    internals = parts.internals
    assert len(internals.state.replies) == 1 and internals.state.attention
    _x, kv = internals.kv_cache.curve.getData()
    assert len(kv) > 0
    assert not internals.timing.pages.empty and not internals.attention.pages.empty

    parts.window.new_chat_action.trigger()
    internals.redraw(force=True)
    assert internals.state.replies == [] and internals.state.attention == {}
    assert internals.state.cache_tokens == 0 and internals.state.roofline.empty
    for panel in internals.panels:  # each says again what it will show
        assert panel.pages.empty, panel
    assert internals.state.info is parts.window.info  # the model stays

    send_and_wait(qtbot, parts, "Again")
    assert [reply.turn for reply in internals.state.replies] == ["turn 1"]
    assert internals.state.reply.reused_tokens == 0  # the new chat's cache started empty


def test_opening_another_conversation_clears_the_panels(qtbot, build, tiny_loader):
    parts = build(tiny_loader)
    send_and_wait(qtbot, parts, "Hello there")
    assert parts.internals.state.replies
    parts.window.set_conversation([])
    parts.internals.redraw(force=True)
    assert parts.internals.state.replies == []
    assert parts.internals.timing.pages.empty


def test_the_roofline_dock_shows_a_real_engines_counts(qtbot, build, tiny_loader, monkeypatch):
    from engine.events import PrefillDone, Token
    from ui.panels import roofline

    monkeypatch.setattr(roofline, "CLOUD_INTERVAL_S", 0.0)  # every frame draws the latest step
    parts = build(tiny_loader)
    events = send_and_wait(qtbot, parts, "Hello there")
    prefill = next(e for e in events if isinstance(e, PrefillDone))
    steps = [e.roofline for e in events if isinstance(e, Token) and e.roofline is not None]
    assert prefill.roofline is not None and steps
    panel = parts.internals.roofline
    assert not panel.pages.empty
    assert list(panel.prefill_points.xData) == [prefill.roofline.intensity]
    assert list(panel.decode_points.xData) == [r.intensity for r in steps]
    assert list(panel.decode_points.yData) == [r.flops_per_s for r in steps]
    assert f"decode: {steps[-1].intensity:.3g} FLOP/byte" in panel.phases.text()
