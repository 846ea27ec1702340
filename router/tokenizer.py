"""Tokenize prompts the way the serving instances do, so prefix lookups and length checks see vLLM's token ids.

With a local tokenizer directory (``tokenizer.json`` + ``tokenizer_config.json``), tokenization runs in-process with
the ``tokenizers`` library and the chat template is rendered with jinja2: no transformers, no torch. Without one,
the proxy asks an instance's ``/tokenize`` endpoint (exact, one extra round trip).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import string
import threading
from pathlib import Path
from typing import Any

import msgspec

from vllm_disagg.router.priority import background_priority
from vllm_disagg.router.upstream import UpstreamClient, UpstreamTimeout

logger = logging.getLogger("vllm_disagg.proxy")


class PromptTokenizer:
    def __init__(self, path: str) -> None:
        from tokenizers import Tokenizer

        d = Path(path)
        self._tok = Tokenizer.from_file(str(d / "tokenizer.json"))
        cfg_path = d / "tokenizer_config.json"
        self.config: dict[str, Any] = json.loads(cfg_path.read_text()) if cfg_path.exists() else {}
        self._template = _compile_template(self.config.get("chat_template"))
        # characters per token of the prompts seen (decayed mean; None before the first): how much text holds a KV
        # block, which sizes the first stage of a long prompt's tokenization (router/intake.py)
        self.chars_per_token: float | None = None
        self._specials = {flag: len(self.encode_text("", flag)) for flag in (True, False)}
        self.splits_at_spaces = all(
            self.encode_text(a + b, flag) == self.encode_text(a, flag) + self.encode_text(b, False)
            for a, b in _SPLIT_PROBES
            for flag in (True, False)
        )
        self._ascii_bounded = all(
            len(self.encode_text(probe, flag)) <= len(probe) + 1 + self._specials[flag]
            for probe in _ASCII_PROBES
            for flag in (True, False)
        )

    def note_length(self, chars: int, tokens: int) -> None:
        """Fold one tokenized text's characters per token into ``chars_per_token``."""
        if chars <= 0 or tokens <= 0:
            return
        ratio = chars / tokens
        cpt = self.chars_per_token
        self.chars_per_token = ratio if cpt is None else 0.9 * cpt + 0.1 * ratio

    def _special(self, name: str) -> str:
        v = self.config.get(name)
        if isinstance(v, dict):
            return str(v.get("content", ""))
        return str(v or "")

    def ascii_token_bound(self, chars: int, add_special_tokens: bool) -> int | None:
        """At most how many tokens an ASCII text of ``chars`` characters becomes, without tokenizing it; None when
        this tokenizer gives no such bound.

        Every token of a BPE, WordPiece or Unigram vocabulary covers at least one byte of its (normalized) text, an
        ASCII character is one byte, and normalizers leave ASCII text as long as it was, so the bound is one token
        per character, one for a prefix space, plus the special tokens. A tokenizer whose pre-processing lengthens
        ASCII text (a space replaced by a multi-byte marker it has no token for) fails the probes at load and gets
        no bound."""
        if not self._ascii_bounded:
            return None
        return chars + 1 + self._specials[add_special_tokens]

    def encode_prompt(self, prompt: str) -> list[int]:
        return self.encode_text(prompt, True)

    def encode_text(self, text: str, add_special_tokens: bool) -> list[int]:
        return _ids(self._tok, text, add_special_tokens)

    def render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        """The prompt vLLM renders for a plain chat (``local_chat`` says which are); ``NotLocal`` where this
        template cannot be rendered here as vLLM would, ``ValueError`` where the template itself refuses the
        messages (its ``raise_exception``: vLLM answers 400 too)."""
        import jinja2

        if self._template is None:
            raise NotLocal("no chat template that renders here")
        try:
            return str(
                self._template.render(
                    messages=messages,
                    add_generation_prompt=add_generation_prompt,
                    bos_token=self._special("bos_token"),
                    eos_token=self._special("eos_token"),
                )
            )
        except _TemplateRefused as refused:
            raise ValueError(f"the chat template refused these messages: {refused}") from None
        except jinja2.TemplateError as exc:
            raise NotLocal(f"the chat template did not render here: {exc}") from None

    async def encode_pieces_off_loop(self, pieces: list[tuple[str, bool]]) -> list[list[int]]:
        """The ids of each (text, add_special_tokens) piece, on the worker thread as ``encode_off_loop``."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(_pool(), _pieces, self._tok, pieces)

    def encode_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> list[int]:
        return self.encode_text(self.render_chat(messages, add_generation_prompt), False)

    async def encode_off_loop(self, text: str, add_special_tokens: bool) -> list[int]:
        """Tokenize on a worker thread at background priority (nice 10), with the GIL released
        (``encode_batch_fast``; plain ``encode`` keeps the GIL, so a thread alone would still stall the event loop).
        On a core it shares with the event loop the worker gets about a tenth of it, so a long prompt barely delays
        another stream's chunks. No character offsets are computed."""
        loop = asyncio.get_running_loop()
        # the ids' list is built on the worker too (for a long prompt, most of a millisecond)
        return await loop.run_in_executor(_pool(), _ids, self._tok, text, add_special_tokens)


class NotLocal(Exception):
    """The chat cannot be rendered here exactly as vLLM renders it: ask an instance (``remote_tokenize``)."""


_PLAIN_ROLES = frozenset({"system", "user", "assistant"})
_PLAIN_MESSAGE_KEYS = frozenset({"role", "content", "name"})
# Chat request fields that change vLLM's rendering beyond messages and add_generation_prompt.
RENDERING_FIELDS = (
    "continue_final_message",
    "add_special_tokens",
    "chat_template",
    "chat_template_kwargs",
    "tools",
    "documents",
    "mm_processor_kwargs",
    "media_io_kwargs",
)


def local_chat(body: dict[str, Any]) -> bool:
    """Whether a chat request renders here as it does in vLLM: string contents, plain roles, no tools, documents or
    template options. vLLM joins a list of text parts, converts roles a template lacks, parses tool calls, and
    passes tools and template options on: those chats go to an instance's /tokenize instead."""
    if any(body.get(k) not in (None, False) for k in RENDERING_FIELDS):
        return False
    messages = body.get("messages")
    return isinstance(messages, list) and all(
        isinstance(m, dict)
        and m.get("role") in _PLAIN_ROLES
        and isinstance(m.get("content"), str)
        and m.keys() <= _PLAIN_MESSAGE_KEYS
        for m in messages
    )


class _TemplateRefused(Exception):
    """A chat template's own ``raise_exception``."""


def _raise_exception(message: str) -> None:
    raise _TemplateRefused(message)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    """Chat templates' ``tojson`` as transformers defines it: plain JSON, no HTML escaping."""
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    import datetime

    return datetime.datetime.now().strftime(fmt)


def _compile_template(source: Any) -> Any:
    """A chat template in the environment transformers gives templates (loop controls, ``raise_exception``,
    ``tojson``, ``strftime_now``); None when there is none or it does not compile here (chats then go to an
    instance's /tokenize)."""
    if not isinstance(source, str):
        return None
    import jinja2
    import jinja2.sandbox

    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateError as exc:
        logger.warning(
            "the tokenizer's chat template does not compile here (%s): chats are tokenized by an instance",
            exc,
        )
        return None


def _pieces(tok: Any, pieces: list[tuple[str, bool]]) -> list[list[int]]:
    return [_ids(tok, text, special) for text, special in pieces]


def _ids(tok: Any, text: str, add_special_tokens: bool) -> list[int]:
    """The token ids of ``text``, through the batch entry point without character offsets: a third less CPU than
    ``encode`` on a short prompt, and the proxy never reads offsets."""
    ids: list[int] = tok.encode_batch_fast([text], False, add_special_tokens)[0].ids
    return ids


# A text cut before a space that follows a word, and the rest: a tokenizer whose ids of the whole are the ids of the
# two parts joined (``splits_at_spaces``) lets a long prompt's tokenization stages read only what the last one did
# not. Punctuation, digits, line breaks, an apostrophe and a non-ASCII word on either side of the cut.
_SPLIT_PROBES = (
    ("The quick brown", " fox jumps over the lazy dog."),
    ("well, it's 1234", " o'clock\nnow: fine"),
    ("naïve café", " déjà vu, encore"),
    ("x = f(a)", " + g(b); return x"),
)

# Texts that would break the one-token-per-ASCII-character bound if the tokenizer expanded them: spaces (a
# metaspace marker), line breaks, tabs, every printable character.
_ASCII_PROBES = (" " * 64, "a " * 32, "\n" * 32, "\t" * 32, " \r\n" * 16, string.printable, "<s></s>" * 8)

_POOL: concurrent.futures.ThreadPoolExecutor | None = None


def _background_thread() -> None:
    """Run this worker thread at background priority (router/priority.py says why not lower)."""
    background_priority(threading.get_native_id())


def _pool() -> concurrent.futures.ThreadPoolExecutor:
    global _POOL
    if _POOL is None:
        _POOL = concurrent.futures.ThreadPoolExecutor(
            max_workers=2, thread_name_prefix="tokenize", initializer=_background_thread
        )
    return _POOL


async def remote_tokenize(pool: UpstreamClient, url: str, model: str, body: dict[str, Any]) -> list[int]:
    """Token ids from an instance's /tokenize (completions: ``prompt``; chat: ``messages``); ``HTTPStatusError``
    for an answer that is not 2xx, ``UpstreamError`` when the instance cannot be reached (or takes over 10 s)."""
    req: dict[str, Any] = {"model": model}
    if "messages" in body:
        req["messages"] = body["messages"]
        req["add_generation_prompt"] = body.get("add_generation_prompt", True)
        for k in RENDERING_FIELDS:
            if body.get(k) is not None and k != "documents":  # vLLM's /tokenize takes no documents
                req[k] = body[k]
    else:
        req["prompt"] = body.get("prompt", "")
    try:
        raw = await asyncio.wait_for(pool.post_json(url, "/tokenize", msgspec.json.encode(req), {}), 10.0)
    except TimeoutError:
        raise UpstreamTimeout(f"{url}/tokenize: no answer within 10 s") from None
    return list(msgspec.json.decode(raw)["tokens"])
