"""The proxy renders a chat's prompt locally only where it renders as vLLM's does; the template gets the functions
and filters transformers gives it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from vllm_disagg.router.tokenizer import NotLocal, PromptTokenizer, local_chat

PLAIN = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]


@pytest.mark.parametrize(
    "body, local",
    [
        ({"messages": PLAIN}, True),
        ({"messages": PLAIN, "add_generation_prompt": False, "continue_final_message": False}, True),
        ({"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}, False),
        ({"messages": [{"role": "assistant", "content": None, "tool_calls": []}]}, False),
        ({"messages": [{"role": "developer", "content": "x"}]}, False),
        ({"messages": [{"role": "tool", "content": "42", "tool_call_id": "c1"}]}, False),
        ({"messages": PLAIN, "tools": [{"type": "function", "function": {"name": "f"}}]}, False),
        ({"messages": PLAIN, "chat_template_kwargs": {"enable_thinking": False}}, False),
        ({"messages": PLAIN, "continue_final_message": True}, False),
        ({"messages": PLAIN, "chat_template": "{{ messages }}"}, False),
    ],
)
def test_only_plain_chats_are_rendered_locally(body: dict[str, Any], local: bool) -> None:
    assert local_chat(body) is local


def _with_template(tiny_model: str, tmp_path: Path, template: str) -> PromptTokenizer:
    d = tmp_path / "tok"
    d.mkdir(parents=True)
    shutil.copy(Path(tiny_model) / "tokenizer.json", d / "tokenizer.json")
    cfg = json.loads((Path(tiny_model) / "tokenizer_config.json").read_text())
    cfg["chat_template"] = template
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    return PromptTokenizer(str(d))


def test_a_template_refusing_the_messages_is_a_clear_error(tiny_model: str, tmp_path: Path) -> None:
    tok = _with_template(
        tiny_model,
        tmp_path,
        "{% if messages[0]['role'] == 'assistant' %}{{ raise_exception('first turn is the user') }}{% endif %}"
        "{% for m in messages %}{{ m['content'] | tojson }}{% if loop.index > 1 %}{% break %}{% endif %}"
        "{% endfor %}",
    )
    assert tok.render_chat([{"role": "user", "content": "<é>"}, {"role": "assistant", "content": "x"}]) == (
        '"<é>""x"'  # transformers' tojson: no HTML escaping, no ASCII escaping; {% break %} works
    )
    with pytest.raises(ValueError, match="first turn is the user"):
        tok.render_chat([{"role": "assistant", "content": "hi"}])


def test_a_template_that_does_not_render_here_goes_to_an_instance(tiny_model: str, tmp_path: Path) -> None:
    tok = _with_template(tiny_model, tmp_path, "{{ some_function_only_vllm_knows() }}")
    with pytest.raises(NotLocal):
        tok.render_chat(PLAIN)
    broken = _with_template(tiny_model, tmp_path / "b", "{% if %}")  # does not compile: still starts
    with pytest.raises(NotLocal):
        broken.render_chat(PLAIN)
