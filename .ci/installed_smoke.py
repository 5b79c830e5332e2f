"""Requests of the installed-package stage: one chat and one image conversation through `warmfleet route`.

Run by .ci/installed.sh with the engine environment's interpreter (httpx, pillow, numpy), from outside the
checkout. Exits non-zero with one line saying what went wrong.
"""

from __future__ import annotations

import base64
import io
import sys
import time

import httpx
import numpy as np
from PIL import Image


def wait_ready(url: str, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    sys.exit(f"installed smoke: {url} not ready after {timeout_s:.0f} s (see the process logs above)")


def png_data_url(seed: int) -> str:
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (84, 112, 3), dtype=np.uint8)).save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


# long enough that the prompt fills more than one KV block (64 tokens), so a repeat has blocks to hit
SYSTEM = "You are a careful assistant who describes pictures in plain words. " * 12


def chat(router: str, model: str, content) -> dict:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": content}]
    body = {"model": model, "messages": messages, "max_tokens": 4, "temperature": 0}
    r = httpx.post(f"{router}/v1/chat/completions", json=body, timeout=300)
    if r.status_code != 200:
        sys.exit(f"installed smoke: chat through the router answered {r.status_code}: {r.text[:300]}")
    return r.json()


def main() -> None:
    replica, router = sys.argv[1], sys.argv[2]
    wait_ready(f"{replica}/ready")
    wait_ready(f"{router}/ready")
    model = httpx.get(f"{router}/v1/models", timeout=10).json()["data"][0]["id"]
    text = chat(router, model, "Say hello to the installed package.")
    assert text["choices"][0]["message"]["content"] is not None and text["usage"]["completion_tokens"] > 0, text
    content = [{"type": "image_url", "image_url": {"url": png_data_url(7)}}, {"type": "text", "text": "What is this?"}]
    first = chat(router, model, content)
    image_tokens = (first["usage"].get("prompt_tokens_details") or {}).get("image_tokens", 0)
    if not image_tokens:
        sys.exit(f"installed smoke: the image request reported no image tokens: {first['usage']}")
    again = chat(router, model, content)  # same image and text: served from the prefix cache
    cached = (again["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    if not cached:
        sys.exit(f"installed smoke: repeating the image request hit no cache: {again['usage']}")
    print(f"installed smoke: chat ok ({text['usage']['completion_tokens']} tokens), image ok "
          f"({image_tokens} image tokens; repeated: {cached} cached)")


if __name__ == "__main__":
    main()
