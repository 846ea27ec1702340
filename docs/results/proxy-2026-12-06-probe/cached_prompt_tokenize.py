"""CPU per prompt of the proxy's intake tokenization (stages, index lookups, key hashing) for prompts whose prefix
one instance holds: 2,000 prompts of ~2,400 characters, each one of 10 prefixes of ~2,100 characters plus its own
~300 (prefix repetition's shape). Run from the repository root: ``taskset -c 1 .venv/bin/python THIS_FILE``."""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[3]
sys.path[:0] = [str(ROOT / "benchmarks"), str(ROOT)]

from proxy import make_prompt  # noqa: E402

from vllm_disagg.router.config import ProxySettings  # noqa: E402
from vllm_disagg.router.intake import encode_bounded  # noqa: E402
from vllm_disagg.router.prefix_index import PrefixIndex, block_keys  # noqa: E402
from vllm_disagg.router.token_cache import PrefixTokenCache  # noqa: E402
from vllm_disagg.router.tokenizer import PromptTokenizer  # noqa: E402


async def main() -> None:
    tok = PromptTokenizer(str(ROOT / ".artifacts" / "tiny-model"))
    prefixes = [make_prompt(2100, 900 + k) for k in range(10)]
    texts = [prefixes[i % 10] + " " + make_prompt(300, 50000 + i) for i in range(2000)]
    for cache in (None, PrefixTokenCache()):
        index = PrefixIndex(block_size=128, pending_ttl_s=1e9)
        for p in prefixes:
            index.record_pending("a", block_keys(tok.encode_text(p, True), 128))
        proxy = SimpleNamespace(
            tokenizer=tok,
            settings=ProxySettings(block_size=128),
            tokenize_worker=None,
            index=index,
            token_cache=cache,
        )
        for text in texts[:50]:
            await encode_bounded(proxy, text, True, None)  # type: ignore[arg-type]
        start = time.process_time()
        for text in texts:
            await encode_bounded(proxy, text, True, None)  # type: ignore[arg-type]
        per = (time.process_time() - start) / len(texts)
        print(
            f"{per * 1e6:.0f} us per cached 2,400-character prompt ({'with' if cache else 'no'} token cache)"
        )


if __name__ == "__main__":
    asyncio.run(main())
