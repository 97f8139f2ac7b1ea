"""The sentence each panel says about the selected step, from the panels' state.

The sentences themselves are in ui.panels.state.sentences; this module picks the step (the
token chosen in any panel, else the latest) and the numbers of it the events delivered.
"""

from __future__ import annotations

from ui.panels.state.internals import InternalsState
from ui.panels.state.sentences import (
    attention_sentence,
    kv_prefill_sentence,
    kv_sentence,
    prompt_token_sentence,
    reply_token_sentence,
    roofline_sentence,
    strongest_head,
    timing_sentence,
)


def kv_line(state: InternalsState) -> str:
    position, step = state.selected_position, state.selected_step
    if state.info is None or position is None:
        return ""
    if step is None or step == 0:  # token 0's logits came from the prefill's pass
        prefix = "Step 0 came from the prefill's pass. " if step == 0 else ""
        trail = state.trail
        return prefix + kv_prefill_sentence(
            min(position, trail.prompt_tokens - 1),
            trail.prompt_tokens,
            trail.processed_tokens,
            state.prefill_kv_bytes,
        )
    return kv_sentence(step, state.step_added_bytes(step), state.info)


def timing_line(state: InternalsState) -> str:
    step = state.selected_step
    reply = state.reply
    if step is None or reply is None:
        return ""
    seconds = state.step_seconds[step]
    if step == 0:
        return (
            f"Step 0 took {seconds * 1e3:.1f} ms: the prompt's prefill and sampling its first token"
        )
    decode = state.step_seconds[1:]
    mean = sum(decode) / len(decode) if decode else None
    return timing_sentence(step, seconds, mean)


def roofline_line(state: InternalsState) -> str:
    step = state.selected_step
    if step is None or state.info is None:
        return ""
    roofline = state.step_rooflines[step]
    if roofline is None:
        return f"Step {step}'s token came from the prefill's pass (the diamond)."
    return roofline_sentence(step, roofline, state.info)


def attention_query(state: InternalsState) -> int | None:
    """The query row of the selected step: the token fed to the pass that made the selected
    one (its own row for a prompt token, processed by the prefill)."""
    position = state.selected_position
    if position is None:
        return None
    return position - 1 if state.step_at(position) is not None else position


def position_of_query(state: InternalsState, query: int) -> int:
    """The token whose step attention row `query` is (attention_query's inverse): the token the
    pass fed `query` made, else, for a prompt row before the last, the prompt token itself."""
    made = query + 1
    return made if state.step_at(made) is not None else query


def attention_line(state: InternalsState, layer: int | None, head: int | None) -> str:
    """Where `head` (else the most decided head) of `layer` looked for the selected step."""
    query = attention_query(state)
    if query is None or layer is None:
        return ""
    row = state.row_at(layer, query)
    if row is None and query in state.pulled.aged_out:
        return (
            f"The attention row of query #{query} has left the engine's memory of recent"
            " steps: only the latest steps' rows are kept."
        )
    rows = state.attention.get(layer)
    waiting = rows is not None and rows.waits_for(query)
    if row is None and (query in state.pulled.asked or waiting):
        return f"The attention row of query #{query} is on its way from the engine."
    if row is None and rows is None:
        return ""
    if row is None:
        return f"The attention row of query #{query} is not kept (only the latest rows are)."
    chosen = head if head is not None and head < row.shape[0] else strongest_head(row)
    weights = row[chosen, : query + 1]
    key = int(weights.argmax())
    label = state.trail.labels[key] if key < len(state.trail.labels) else state.token_text(key)
    step = state.selected_step
    where = f"Step {step} (query #{query})" if step is not None else f"Prompt token #{query}"
    return f"{where}: " + attention_sentence(layer, chosen, weights, query, label)


def tokens_line(state: InternalsState) -> str:
    """What the selected token is: the step that produced it, or its place in the prompt."""
    position, trail = state.selected_position, state.trail
    if position is None:
        return ""
    token_id, label = trail.ids[position], trail.labels[position]
    step = state.step_at(position)
    if step is None:
        special = trail.is_special(position)
        return prompt_token_sentence(
            position, token_id, label, special, trail.prompt_tokens, trail.reused_tokens
        )
    return reply_token_sentence(step, token_id, label, trail.prompt_tokens, trail.reused_tokens)
