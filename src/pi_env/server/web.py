"""The web UI at /web (Gradio, mounted by OpenEnv's `create_app(gradio_builder=...)`).

Pick an endpoint (the catalog shows what this server has configured) and a preset from the
bundled examples, edit the task, Run: the live phase log shows each phase and each model call
as it happens; then the reward and verify table, the logprob plot (every generated token across
the rollout, turns marked, unlikely tokens in red), the files, the conversation, logs and the
raw RolloutResult. Rollouts go through the same `RolloutService` as MCP, so the same limit and
queue apply. The API key is kept server-side for the browser session (gr.State) and the field
is cleared on Run, so it never comes back to the page.
"""

from __future__ import annotations

import asyncio
import html
import json
import logging
import os
import queue
from pathlib import Path
from typing import Any

import gradio as gr

from ..agent import agent_names
from ..config import BLACK_BOX, TRANSPARENT_PROXY
from ..results import RolloutEvent, RolloutResult
from ..task import PiTask, TaskError, load_tasks
from .limiter import ServerBusy, idle_timeout_s
from .rollouts import MODES, BadArguments, RolloutService, catalog_summary, scrub, scrub_result

log = logging.getLogger("pi_env.server.web")
EXTRA_FIELDS = ("task_id", "files", "verify_files", "solution")
LOW_LOGPROB = -2.3  # p < 0.1: drawn red


def load_presets() -> dict[str, PiTask]:
    """The bundled example tasks ($PI_ENV_EXAMPLES, else the repository's examples/)."""
    directory = Path(os.environ.get("PI_ENV_EXAMPLES") or Path(__file__).resolve().parents[3] / "examples")
    try:
        return {task.task_id: task for task in load_tasks(directory)}
    except (TaskError, OSError):
        return {}


def gradio_builder(
    service: RolloutService,
    web_manager=None,
    action_fields=None,
    metadata=None,
    is_chat_env=False,
    title: str = "pi-env",
    quick_start_md: str = "",
) -> gr.Blocks:
    presets = load_presets()
    catalog = catalog_summary()
    endpoint_choices = [
        (f"{row['name']} ({'configured' if row['configured'] else 'not configured'})", row["name"]) for row in catalog
    ]

    by_page: dict[str | None, set[asyncio.Future]] = {}  # the running rollouts of each open tab
    with gr.Blocks(title="pi-env") as blocks:
        # The key kept for the tab is dropped once the tab has been idle PI_ENV_IDLE_TIMEOUT_S.
        stored_key = gr.State(None, time_to_live=idle_timeout_s())
        gr.Markdown(
            "## pi-env: the Pi coding agent in a sandbox, scored\n"
            f"At most **{service.limiter.max_running}** rollouts run at once on this server; "
            f"{service.limiter.max_waiting} more may wait, beyond that a run is refused as busy. "
            "The `oracle` endpoint replays a task's reference solution (synthetic, no model needed)."
        )
        with gr.Row():
            endpoint = gr.Dropdown(
                endpoint_choices,
                value="oracle",
                label="Endpoint (or an http(s) URL)",
                allow_custom_value=True,
                elem_id="endpoint",
            )
            model = gr.Textbox(label="Model", placeholder="the endpoint's default", elem_id="model")
            api_key = gr.Textbox(
                label="API key",
                type="password",
                elem_id="api-key",
                placeholder="kept on the server for this browser session",
            )
            mode = gr.Radio(list(MODES), value=TRANSPARENT_PROXY, label="Mode", elem_id="mode")
            agent = gr.Dropdown(
                agent_names(), value=service.agent or "pi", label="Agent", elem_id="agent", allow_custom_value=False
            )
            max_turns = gr.Number(value=50, precision=0, label="Max model calls", minimum=1)
        preset = gr.Dropdown(list(presets), value=None, label="Preset (bundled examples)", elem_id="preset")
        instruction = gr.Textbox(lines=3, label="Instruction", elem_id="instruction")
        with gr.Row():
            setup = gr.Textbox(lines=3, label="Setup (one command per line)", elem_id="setup")
            verify = gr.Textbox(lines=3, label="Verify (one command per line)", elem_id="verify")
        extras = gr.Code("{}", language="json", label="task_id, files, verify_files, solution (JSON)", elem_id="extras")
        with gr.Row():
            run_button = gr.Button("Run", variant="primary", elem_id="run")
            cancel_button = gr.Button("Cancel", variant="stop", elem_id="cancel")
        # What the agent or a task wrote (and errors quoting it) is shown as text: escaped into
        # gr.HTML, never rendered as markdown or HTML (no forms, overlays or remote images).
        status = gr.HTML(elem_id="status")
        phase_log = gr.Textbox(label="Live phase log", lines=10, max_lines=30, autoscroll=True, elem_id="phase-log")
        reward = gr.HTML(elem_id="reward")
        verify_table = gr.Dataframe(
            headers=["verify command", "exit", "seconds", "output"], label="Verify", elem_id="verify-table", wrap=True
        )
        plot = gr.HTML(elem_id="logprob-plot")
        with gr.Tabs():
            with gr.Tab("Files"):
                files = gr.HTML(elem_id="files")
            with gr.Tab("Conversation"):
                conversation = gr.HTML(elem_id="conversation")
            with gr.Tab("Logs"):
                logs = gr.Textbox(lines=15, label="agent and gateway logs", elem_id="logs")
            with gr.Tab("Raw JSON"):
                raw = gr.Code(language="json", elem_id="raw-json")

        def pick(name: str | None):
            task = presets.get(name or "")
            if task is None:
                return gr.update(), gr.update(), gr.update(), gr.update()
            extra = task.model_dump(include=set(EXTRA_FIELDS), exclude_none=True)
            return task.instruction, "\n".join(task.setup), "\n".join(task.verify), json.dumps(extra, indent=2)

        preset.change(pick, preset, [instruction, setup, verify, extras])

        views = [stored_key, api_key, status, phase_log, reward, verify_table, plot, files, conversation, logs, raw]

        async def run(
            endpoint_,
            model_,
            key_,
            kept_key,
            mode_,
            agent_,
            max_turns_,
            instruction_,
            setup_,
            verify_,
            extras_,
            request: gr.Request,
        ):
            key = key_ or kept_key
            yield {
                stored_key: key,
                api_key: "",
                status: _text("Checking the task…"),
                phase_log: "",
                reward: "",
                verify_table: None,
                plot: "",
                files: "",
                conversation: "",
                logs: "",
                raw: "",
            }
            try:
                extra = json.loads(extras_ or "{}")
                if not isinstance(extra, dict):
                    raise BadArguments("the JSON box holds an object with task_id, files, verify_files, solution")
                unknown = sorted(set(extra) - set(EXTRA_FIELDS))
                if unknown:
                    raise BadArguments(f"the JSON box has unknown keys {unknown}; allowed: {list(EXTRA_FIELDS)}")
                arguments = {
                    **extra,
                    "endpoint": endpoint_ or "oracle",
                    "model": model_ or None,
                    "api_key": key,
                    "mode": mode_,
                    "agent": agent_ or None,
                    "max_turns": int(max_turns_) if max_turns_ else None,
                    "instruction": instruction_ or None,
                    "setup": _lines(setup_),
                    "verify": _lines(verify_),
                }
                task, config = service.build(arguments)
            except json.JSONDecodeError as error:
                yield {status: _text(f"❌ the JSON box is not valid JSON: {error}")}
                return
            except BadArguments as error:
                yield {status: _text(f"❌ {scrub(str(error), key)}")}
                return
            lines: list[str] = []
            events: queue.SimpleQueue = queue.SimpleQueue()
            running = asyncio.ensure_future(
                service.run(
                    task,
                    config,
                    on_event=events.put,
                    on_queued=lambda position: events.put(f"waiting for a free slot (position {position})"),
                )
            )
            session = getattr(request, "session_hash", None)
            by_page.setdefault(session, set()).add(running)
            running.add_done_callback(lambda done: by_page.get(session, set()).discard(done))
            try:
                while not running.done():
                    await asyncio.wait({running}, timeout=0.25)
                    fresh = _drain(events, key)
                    if fresh:
                        lines.extend(fresh)
                        state = "⏳ Waiting for a free slot…" if "waiting for" in lines[-1] else "🏃 Running…"
                        yield {status: _text(state), phase_log: "\n".join(lines)}
                result = running.result()
            except ServerBusy as error:
                yield {status: _text(f"⛔ {error}")}
                return
            except Exception as error:  # noqa: BLE001 - shown to the user, never a stack trace
                log.warning("web rollout failed: %s", scrub(repr(error), key))  # no traceback: it repeats the message
                yield {status: _text(f"❌ {type(error).__name__}: {scrub(str(error), key)}")}
                return
            finally:
                if not running.done():  # cancelled (the Cancel button) or the page went away
                    running.cancel()
            lines.extend(_drain(events, key))
            yield _result_views(
                result, key, lines, status, phase_log, reward, verify_table, plot, files, conversation, logs, raw
            )

        run_event = run_button.click(
            run,
            [endpoint, model, api_key, stored_key, mode, agent, max_turns, instruction, setup, verify, extras],
            views,
            concurrency_limit=None,
        )
        cancel_button.click(
            lambda: _text("🛑 Cancelled: the agent was stopped and its sandbox deleted."),
            None,
            status,
            cancels=[run_event],
        )

        async def page_closed(request: gr.Request):  # async: runs on the loop that owns the futures
            """The tab went away (Gradio's heartbeat stream ended): its rollouts, queued or
            running, are cancelled now, not left to run out their time limits."""
            for running in by_page.pop(getattr(request, "session_hash", None), set()):
                running.cancel()

        blocks.unload(page_closed)
    return blocks


def _lines(text: str | None) -> list[str] | None:
    commands = [line for line in (text or "").splitlines() if line.strip()]
    return commands or None


def _drain(events: queue.SimpleQueue, key: str | None) -> list[str]:
    """The live log's new lines, scrubbed like a result's upstream errors (a line may quote one)."""
    lines: list[str] = []
    while True:
        try:
            item = events.get_nowait()
        except queue.Empty:
            return lines
        lines.append(scrub(item if isinstance(item, str) else event_line(item), key))


def event_line(event: RolloutEvent) -> str:
    at = f"[{event.elapsed_s:7.2f} s]"
    if event.kind == "turn" and event.turn is not None:  # a turn event always carries its turn
        turn = event.turn
        logps = [x for x in turn.per_token_logps if x is not None]
        detail = f", min logprob {min(logps):.2f}" if logps else ""
        error = f", upstream {turn.upstream_status}: {turn.upstream_error[:120]}" if turn.upstream_error else ""
        return (
            f"{at} model call {turn.turn}: {turn.completion_tokens or 0} tokens, finish {turn.finish_reason}, "
            f"{turn.latency_s or 0:.2f} s{detail}{error}"
        )
    if event.kind == "done":
        return f"{at} done: reward {event.reward}" + (f" ({event.error_kind})" if event.error_kind else "")
    return f"{at} {event.phase} {'…' if event.kind == 'phase_start' else 'done'}"


def _result_views(
    result: RolloutResult, key, lines, status, phase_log, reward, verify_table, plot, files, conversation, logs, raw
) -> dict:
    data = scrub_result(result.model_dump(mode="json"), key)
    if result.reward is not None:
        headline = f"Reward: {result.reward}" + (" (synthetic: oracle)" if result.synthetic else "")
    else:
        headline = f"Reward: none ({result.error_kind}: {scrub(result.error or '', key)})"
    rows = [[r.cmd, r.exit_code, r.duration_s, (r.stderr or r.stdout)[-300:]] for r in result.verify_results]
    return {
        status: _text(f"✅ Finished in {result.wall_s:.1f} s, {len(result.proxy_turns)} model calls"),
        phase_log: "\n".join(lines),
        reward: _text(headline, "h2"),
        verify_table: rows or None,
        plot: logprob_svg(result),
        files: _files_html(data["files"]),
        conversation: _conversation_html(data["messages"]),
        logs: f"{data['agent_log_tail']}\n--- gateway ---\n{data['proxy_log_tail']}",
        raw: json.dumps(data, indent=1),
    }


def logprob_svg(result: RolloutResult, width: int = 960, height: int = 220) -> str:
    """Every generated token's logprob across the rollout, one bar each (the deeper, the less
    likely), turns separated and labelled, tokens with p < 0.1 in red. An SVG, so it needs no
    plotting library and renders at once."""
    points = [(turn.turn, logp) for turn in result.proxy_turns for logp in turn.per_token_logps]
    if not points:
        why = (
            "mode black_box records no logprobs: choose transparent_proxy"
            if result.mode == BLACK_BOX
            else "the endpoint returned no logprobs"
        )
        return f'<div id="logprob-empty">No per-token logprobs ({html.escape(why)}).</div>'
    reported = [logp for _, logp in points if logp is not None]
    floor = min([-1.0, *reported])
    top, bottom, left = 18, height - 22, 40
    step = (width - left - 10) / len(points)
    parts = [
        f'<svg id="logprob-svg" xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" role="img" aria-label="per-token logprobs">',
        f'<text x="{left}" y="12" font-size="11">per-token logprob of {len(points)} generated tokens '
        f"(red: p &lt; 0.1; gaps: not reported)</text>",
        f'<line x1="{left}" y1="{top}" x2="{width - 10}" y2="{top}" stroke="#999"/>',
        f'<text x="2" y="{top + 4}" font-size="10">0</text>',
        f'<text x="2" y="{bottom}" font-size="10">{floor:.1f}</text>',
    ]
    low = 0
    previous_turn = None
    for index, (turn, logp) in enumerate(points):
        x = left + index * step
        if turn != previous_turn:
            parts.append(
                f'<line class="turn-mark" x1="{x:.1f}" y1="{top}" x2="{x:.1f}" y2="{bottom}" '
                f'stroke="#555" stroke-dasharray="3,3"/><text x="{x + 2:.1f}" y="{bottom + 14}" '
                f'font-size="10">turn {turn}</text>'
            )
            previous_turn = turn
        if logp is None:
            continue
        is_low = logp < LOW_LOGPROB
        low += is_low
        bar = (bottom - top) * (logp / floor)
        color = "#d62728" if is_low else ("#ff9f1c" if logp < -0.5 else "#2ca02c")
        parts.append(
            f'<rect class="{"low" if is_low else "tok"}" x="{x:.1f}" y="{top}" width="{max(step * 0.9, 0.5):.2f}" '
            f'height="{max(bar, 0.5):.1f}" fill="{color}"><title>turn {turn}, token {index}: '
            f"logprob {logp:.3f}</title></rect>"
        )
    parts.append("</svg>")
    return f'<div id="logprob-plot-inner">{"".join(parts)}<div>{low} of {len(points)} tokens below p = 0.1</div></div>'


def _text(text: str, tag: str = "p") -> str:
    """`text` as text: escaped, in a <pre>-like element that keeps its lines."""
    return f'<{tag} style="white-space: pre-wrap">{html.escape(text)}</{tag}>'


def _files_html(files: dict[str, str]) -> str:
    if not files:
        return _text("No files in the work dir.")
    return "".join(f"<h4>{html.escape(path)}</h4>{_text(text[:20000], 'pre')}" for path, text in sorted(files.items()))


def _conversation_html(messages: list[dict[str, Any]]) -> str:
    blocks = []
    for message in messages:
        role = message.get("role", "?")
        content = message.get("content")
        parts = []
        for block in content if isinstance(content, list) else [{"type": "text", "text": content or ""}]:
            if not isinstance(block, dict):
                continue
            if block.get("type") == "text":
                parts.append(block.get("text", ""))
            elif block.get("type") == "toolCall":
                parts.append(f"→ {block.get('name')} {json.dumps(block.get('arguments'))[:2000]}")
            elif block.get("type") == "thinking":
                parts.append(f"(thinking) {block.get('thinking', '')[:2000]}")
        reasoning = message.get("reasoning_content") or message.get("reasoning")
        if isinstance(reasoning, str) and reasoning:  # the gateway's record (OpenAI shape)
            parts.insert(0, f"(thinking) {reasoning[:2000]}")
        for call in message.get("tool_calls") or []:
            function = (call.get("function") or {}) if isinstance(call, dict) else {}
            parts.append(f"→ {function.get('name')} {str(function.get('arguments'))[:2000]}")
        body = "\n\n".join(part for part in parts if part)
        blocks.append(
            f"<h4>{html.escape(str(role))}</h4>{_text(body[:4000] if role in ('tool', 'toolResult') else body, 'pre')}"
        )
    return "<hr>".join(blocks) or _text("No conversation.")
