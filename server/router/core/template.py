"""The router's chat-template render: minijinja (Rust) for the message shapes it renders as the replica does.

The replica renders with Jinja2 as Hugging Face does (`warmfleet.server.tokenizer`); that render of the
whole conversation was 14 % of the router's CPU per chat request, 53 µs against minijinja's 8 µs on the
bench's four-message chats (docs/router.md, "Where a request's CPU goes"). minijinja is the engine the
Rust gateways (SGLang's, vllm-router, TGI) render chat templates with, but it is not Jinja2: a template
may use what only one of them has (Python string methods, `{% generation %}`, a dict printed as a repr).
So the router uses it only where it was shown to agree:

- at start-up both engines render probe conversations (every role order the common templates branch on,
  contents with edge whitespace, markers and Unicode, text and image parts, with and without the
  generation prompt); any difference or any error only one of them raises, and the router keeps Jinja2;
- a request is rendered by minijinja only when its messages have the probed shape (roles system, user,
  assistant; content a string or text/image parts; no tools, tool calls or other fields); anything else,
  and any error minijinja raises, goes to Jinja2, whose answer (or ChatTemplateError) is the replica's.

A render that still differed would cost cache hits (the router would predict other block hashes than
the replica computes), never a wrong answer: the replica renders its prompt itself.
"""

from __future__ import annotations

import logging
from typing import Any, Optional, Sequence

from ...tokenizer import TEMPLATE_FILTERS, TEMPLATE_GLOBALS

log = logging.getLogger(__name__)

ROLES = frozenset({"system", "user", "assistant"})
MESSAGE_KEYS = frozenset({"role", "content"})
PART_TYPES = frozenset({"text", "image", "image_url"})

_EDGE_TEXTS = ("  leading and trailing  \n", "", "line one\n\nline two\t end", "ü ☃ 漢字 🙂",
               "<think>\nreasoning\n</think>\n\nanswer", "{{ not a tag }} {% raw %}", "\n")


def _probe_conversations(openai_content: bool) -> list[list[dict]]:
    """Conversations the two engines must render alike before minijinja is trusted with a template."""
    s, u, a = ({"role": r, "content": f"{r} says hi"} for r in ("system", "user", "assistant"))
    convs = [[u], [s, u], [s, u, a, u], [u, a, u, a], [u, a], [s], [s, u, a, u, a, u]]
    for i, text in enumerate(_EDGE_TEXTS):
        convs.append([{"role": "system", "content": text}, {"role": "user", "content": text},
                      {"role": "assistant", "content": text}, {"role": "user", "content": _EDGE_TEXTS[i - 1]}])
    text_parts = [{"type": "text", "text": "first"}, {"type": "text", "text": " second\n"}]
    convs.append([{"role": "user", "content": text_parts}, a, {"role": "user", "content": text_parts[:1]}])
    if openai_content:
        image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
        convs += [[{"role": "user", "content": [image, {"type": "text", "text": "what is this?"}]}],
                  [s, {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image"}, image]}, a,
                   {"role": "user", "content": [image, image]}]]
    return convs


def probed_shape(messages: Sequence[Any]) -> bool:
    """Whether every message has a shape the start-up probes covered."""
    for m in messages:
        if type(m) is not dict or not m.keys() <= MESSAGE_KEYS or m.get("role") not in ROLES:
            return False
        content = m.get("content")
        if type(content) is str:
            continue
        if type(content) is not list:
            return False
        for p in content:
            if type(p) is not dict or p.get("type") not in PART_TYPES:
                return False
    return True


class FastChatTemplate:
    """`render(messages, add_generation_prompt)`: the prompt text by minijinja, or None where Jinja2 must render."""

    def __init__(self, tokenizer: Any, env: Any):
        self.tokenizer = tokenizer
        self.env = env
        self.rendered = self.declined = 0  # requests minijinja rendered / left to Jinja2

    @classmethod
    def for_tokenizer(cls, tokenizer: Any) -> Optional["FastChatTemplate"]:
        """None without minijinja, without a chat template, or when any probe renders differently."""
        template = getattr(tokenizer, "chat_template", None)
        if not template or not hasattr(tokenizer, "template_context"):
            return None
        try:
            import minijinja
        except ImportError:
            return None
        try:
            env = minijinja.Environment(templates={"chat": template}, trim_blocks=True, lstrip_blocks=True,
                                        keep_trailing_newline=False, debug=False)
            for name, fn in TEMPLATE_FILTERS.items():
                env.add_filter(name, fn)
            for name, fn in TEMPLATE_GLOBALS.items():
                env.add_global(name, fn)
        except Exception as exc:  # a template minijinja cannot parse (e.g. `{% generation %}`)
            log.info("chat template: minijinja cannot compile it (%s); rendering with Jinja2", exc)
            return None
        fast = cls(tokenizer, env)
        for conv in _probe_conversations(tokenizer.content_format == "openai"):
            for add_gen in (True, False):
                why = fast._disagreement(conv, add_gen)
                if why:
                    log.info("chat template: minijinja %s on a probe of %d messages; rendering with Jinja2",
                             why, len(conv))
                    return None
        return fast

    def _disagreement(self, conv: list[dict], add_gen: bool) -> Optional[str]:
        try:
            want: Optional[str] = self.tokenizer.apply_chat_template(conv, add_generation_prompt=add_gen)
        except ValueError:  # the template refuses this conversation (ChatTemplateError): minijinja must too
            want = None
        try:
            got: Optional[str] = self._render(conv, add_gen)
        except Exception:
            got = None
        if got == want:
            return None
        return "renders differently" if got is not None and want is not None else "errs alone"

    def _render(self, messages: Sequence[Any], add_gen: bool) -> str:
        return self.env.render_template("chat", **self.tokenizer.template_context(list(messages), add_gen))

    def render(self, messages: Sequence[Any], add_generation_prompt: bool = True) -> Optional[str]:
        if probed_shape(messages):
            try:
                text = self._render(messages, add_generation_prompt)
            except Exception:  # raise_exception, or a path the probes did not take: Jinja2 has the last word
                pass
            else:
                self.rendered += 1
                return text
        self.declined += 1
        return None
