"""The panels show the chat on screen: a new chat, or another conversation opened, clears them."""

from __future__ import annotations

from tests.ui.test_assembled_window import send_and_wait


def test_new_chat_clears_the_panels(qtbot, build, tiny_loader):
    parts = build(tiny_loader)
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
