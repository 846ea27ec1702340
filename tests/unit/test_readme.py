"""The README's code examples run as written."""

from __future__ import annotations

import re

from support.paths import ROOT

from vllm_disagg.router import ClusterView, InstanceView, RequestView


def _python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)


def test_readme_policy_example_plans() -> None:
    (block,) = [b for b in _python_blocks() if "def plan(" in b]
    ns: dict[str, object] = {}
    exec(compile(block, "README.md", "exec"), ns)  # noqa: S102 - our own documentation
    policy = ns["ShortPromptsStayLocal"]()  # type: ignore[operator]
    cluster = ClusterView(
        (
            InstanceView("p0", "prefill"),
            InstanceView("d0", "decode", cached_tokens=900),
            InstanceView("d1", "decode", in_flight=3),
        )
    )
    short = policy.plan(RequestView("r1", prompt_tokens=1000), cluster)
    assert (short.mode, short.decode) == ("recompute", "d0")
    long = policy.plan(RequestView("r2", prompt_tokens=5000), cluster)
    assert (long.mode, long.prefill, long.decode) == ("transfer", "p0", "d0")


def test_readme_quickstart_has_exactly_the_two_commands() -> None:
    text = (ROOT / "README.md").read_text()
    quick = text.split("## Quickstart", 1)[1].split("\n## ", 1)[0]
    cmds = [
        ln.strip()
        for b in re.findall(r"```bash\n(.*?)```", quick, re.S)
        for ln in b.splitlines()
        if ln.strip()
    ]
    assert cmds == ["make demo", "make test"]
    assert "make test" in (ROOT / ".ci" / "run").read_text()
