"""Text side of a checkpoint: tokenizer.json, chat template, EOS ids, streaming detokenization, stop strings; no paddle.

The chat template renders in a sandboxed Jinja environment configured like Hugging Face's
(`trim_blocks`, `lstrip_blocks`, `loopcontrols`, `tojson`, `raise_exception`), so a prompt
rendered here is the prompt `transformers` would render, and the router, which tokenizes
too, computes the same block hashes as a replica.
"""

from __future__ import annotations

import json
import re
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any, Iterable, Optional, Sequence


class ChatTemplateError(ValueError):
    """The chat template rejected the conversation (its `raise_exception`) or failed to render."""


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def _token_str(value: Any) -> Optional[str]:
    """tokenizer_config stores special tokens as a string or as an AddedToken dict."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


# A template that loops over message content (or tests `content is string`) accepts OpenAI
# content-part lists (Qwen2-VL); any other template wants a plain string per message.
_OPENAI_CONTENT_RE = re.compile(
    r"for\s+\w+\s+in\s+\w+(?:\[['\"]content['\"]\]|\.content)|content['\"]?\]?\s+is\s+(?:not\s+)?string"
)


class Tokenizer:
    """`tokenizers` fast tokenizer plus the checkpoint's special tokens and chat template."""

    def __init__(self, model_dir: str | Path):
        from tokenizers import Tokenizer as _HFTokenizer

        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"{path} not found (only fast tokenizers with tokenizer.json are supported)")
        self.model_dir = model_dir
        self._tok = _HFTokenizer.from_file(str(path))
        cfg = _read_json(model_dir / "tokenizer_config.json")
        gen = _read_json(model_dir / "generation_config.json")
        model_cfg = _read_json(model_dir / "config.json")

        self.bos_token = _token_str(cfg.get("bos_token"))
        self.eos_token = _token_str(cfg.get("eos_token"))
        self.pad_token = _token_str(cfg.get("pad_token"))
        self.unk_token = _token_str(cfg.get("unk_token"))
        self.additional_special_tokens = [t for t in map(_token_str, cfg.get("additional_special_tokens", [])) if t]
        self.bos_token_id = self._id_or_none(self.bos_token)
        self.pad_token_id = self._id_or_none(self.pad_token)
        self.eos_token_ids = self._eos_ids(gen, model_cfg)
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.all_special_ids = frozenset(i for i, t in self._tok.get_added_tokens_decoder().items() if t.special)
        self.chat_template = self._find_chat_template(cfg, model_dir)

    # ---- ids ----------------------------------------------------------------------------------
    def _id_or_none(self, token: Optional[str]) -> Optional[int]:
        return None if token is None else self._tok.token_to_id(token)

    def _eos_ids(self, gen: dict, model_cfg: dict) -> list[int]:
        """generation_config `eos_token_id` (int or list), else tokenizer_config `eos_token`, else config.json."""
        for source in (gen.get("eos_token_id"), self._id_or_none(self.eos_token), model_cfg.get("eos_token_id")):
            if source is None:
                continue
            ids = [source] if isinstance(source, int) else list(source)
            if ids:
                return list(dict.fromkeys(int(i) for i in ids))
        return []

    def token_to_id(self, token: str) -> Optional[int]:
        return self._tok.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Ids outside the tokenizer (a model vocab padded past it) decode to nothing."""
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)


    # ---- chat template ------------------------------------------------------------------------
    @staticmethod
    def _find_chat_template(cfg: dict, model_dir: Path) -> Optional[str]:
        """tokenizer_config `chat_template` (str, or the named list's "default"), else chat_template.jinja/.json."""
        tpl = cfg.get("chat_template")
        if isinstance(tpl, list):
            named = {t["name"]: t["template"] for t in tpl}
            tpl = named.get("default") or next(iter(named.values()), None)
        if tpl:
            return tpl
        jinja_file = model_dir / "chat_template.jinja"
        if jinja_file.is_file():
            return jinja_file.read_text(encoding="utf-8")
        return _read_json(model_dir / "chat_template.json").get("chat_template")

    @cached_property
    def _compiled_template(self):
        if not self.chat_template:
            raise ChatTemplateError(f"{self.model_dir} has no chat template; use the completions API")
        return _jinja_env().from_string(self.chat_template)

    @cached_property
    def content_format(self) -> str:
        """"openai" when the template iterates content parts, else "string"."""
        return "openai" if _OPENAI_CONTENT_RE.search(self.chat_template or "") else "string"

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: Optional[list[dict]] = None, **template_kwargs: Any) -> str:
        """Render OpenAI-style messages to the prompt string (no tokenization).

        Content may be a string or a list of content parts. Templates that only accept strings
        get the text parts joined with "\\n" and reject non-text parts; templates that iterate
        parts (Qwen2-VL) get the list. Tool-call arguments given as JSON strings (OpenAI's wire
        form) are parsed to objects first, since templates serialize them with `tojson`.
        """
        from jinja2.exceptions import TemplateError

        context = self.template_context(messages, add_generation_prompt, tools, **template_kwargs)
        try:
            return self._compiled_template.render(**context)
        except TemplateError as exc:
            raise ChatTemplateError(f"chat template failed: {exc}") from exc

    def template_context(self, messages: list[dict], add_generation_prompt: bool = True,
                         tools: Optional[list[dict]] = None, **template_kwargs: Any) -> dict:
        """The variables the chat template renders with (messages prepared as `apply_chat_template` says)."""
        if not self.chat_template:
            raise ChatTemplateError(f"{self.model_dir} has no chat template; use the completions API")
        special = {"bos_token": self.bos_token, "eos_token": self.eos_token, "pad_token": self.pad_token,
                   "unk_token": self.unk_token, "additional_special_tokens": self.additional_special_tokens}
        return {"messages": [self._prepare_message(m) for m in messages], "tools": tools, "documents": None,
                "add_generation_prompt": add_generation_prompt, **special, **template_kwargs}

    def _prepare_message(self, message: dict) -> dict:
        msg = dict(message)
        content = msg.get("content")
        if isinstance(content, list) and self.content_format == "string":
            texts = []
            for part in content:
                if part.get("type") != "text":
                    raise ChatTemplateError(f"this model's chat template accepts only text, got a {part.get('type')!r} part")
                texts.append(part.get("text", ""))
            msg["content"] = "\n".join(texts)
        if msg.get("tool_calls"):
            msg["tool_calls"] = [_parse_tool_call_arguments(tc) for tc in msg["tool_calls"]]
        return msg


def _parse_tool_call_arguments(tool_call: dict) -> dict:
    fn = tool_call.get("function")
    if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
        try:
            args = json.loads(fn["arguments"])
        except json.JSONDecodeError:
            return tool_call  # leave malformed arguments as the client sent them
        return {**tool_call, "function": {**fn, "arguments": args}}
    return tool_call


def _tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    """The chat templates' `tojson` filter as transformers defines it (no HTML escaping, Unicode kept)."""
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


# what Hugging Face gives chat templates besides Jinja's own, for every engine rendering them (core/template.py)
TEMPLATE_FILTERS = {"tojson": _tojson}
TEMPLATE_GLOBALS = {"raise_exception": _raise_exception, "strftime_now": _strftime_now}


def _jinja_env():
    """Sandboxed environment with Hugging Face's chat-template settings and helpers."""
    from jinja2 import nodes
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationTag(Extension):
        """`{% generation %}...{% endgeneration %}` (HF's assistant-mask marker) renders its body."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_render", []), [], [], body).set_lineno(lineno)

        def _render(self, caller):
            return caller()

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[GenerationTag, loopcontrols])
    env.filters.update(TEMPLATE_FILTERS)
    env.globals.update(TEMPLATE_GLOBALS)
    return env


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas that never split a UTF-8 character.

    Decodes a short window `ids[prefix_offset:]` and emits what it adds over
    `ids[prefix_offset:read_offset]`; while the window ends in U+FFFD (a multi-byte
    character whose remaining bytes have not arrived), nothing is emitted. The window
    keeps earlier tokens as context because some decoders (SentencePiece's leading space,
    a character split across tokens) decode a token differently after its neighbours.

        ids:  [ ... emitted ... | prefix_offset ... read_offset | new tokens ]
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = (), skip_special_tokens: bool = True):
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self.ids: list[int] = list(prompt_ids[-5:])  # a little prompt context, never emitted
        self.prefix_offset = 0
        self.read_offset = len(self.ids)

    def push(self, token_ids: Iterable[int]) -> str:
        """Append generated ids and return the newly completed text (possibly "")."""
        self.ids.extend(token_ids)
        prefix_text = self._tok.decode(self.ids[self.prefix_offset:self.read_offset], self._skip)
        full_text = self._tok.decode(self.ids[self.prefix_offset:], self._skip)
        if len(full_text) > len(prefix_text) and not full_text.endswith("\ufffd"):
            delta = full_text[len(prefix_text):]
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
            return delta
        return ""

    def flush(self) -> str:
        """At the end of a stream: whatever is still held back (invalid bytes become U+FFFD)."""
        prefix_text = self._tok.decode(self.ids[self.prefix_offset:self.read_offset], self._skip)
        full_text = self._tok.decode(self.ids[self.prefix_offset:], self._skip)
        self.prefix_offset = self.read_offset = len(self.ids)
        return full_text[len(prefix_text):]


class StopStringMatcher:
    """Finds stop strings in streamed text, holding back any tail that could begin one.

    `push(delta)` returns (text safe to emit, stopped). Once stopped, the text after the stop
    string is dropped; `include_stop` keeps the stop string itself in the output.
    """

    def __init__(self, stop: Sequence[str], include_stop: bool = False):
        self.stop = [s for s in stop if s]
        self.include_stop = include_stop
        self._held = ""
        self.stopped_on: Optional[str] = None
        self._max_hold = max((len(s) for s in self.stop), default=1) - 1

    def push(self, delta: str) -> tuple[str, bool]:
        if self.stopped_on is not None:
            return "", True
        buf = self._held + delta
        hit = min(((buf.find(s), s) for s in self.stop if s in buf), default=None)
        if hit is not None:
            idx, s = hit
            self._held = ""
            self.stopped_on = s
            return buf[: idx + (len(s) if self.include_stop else 0)], True
        keep = 0
        for n in range(min(self._max_hold, len(buf)), 0, -1):
            tail = buf[-n:]
            if any(s.startswith(tail) for s in self.stop):
                keep = n
                break
        self._held = buf[len(buf) - keep:] if keep else ""
        return buf[: len(buf) - keep], False

    def flush(self) -> str:
        """At the end of a stream without a stop: the held-back tail."""
        held, self._held = self._held, ""
        return "" if self.stopped_on is not None else held
