"""The admin journal every worker follows: appends, reads, and what a replay can skip."""

from __future__ import annotations

from pathlib import Path

from vllm_disagg.router.admin_journal import AdminJournal, undone_later


def test_a_replay_skips_what_a_later_entry_undoes(tmp_path: Path) -> None:
    j = AdminJournal(str(tmp_path), worker=0, workers=2)
    add = lambda iid: {"op": "add", "id": iid, "config": {"url": f"http://{iid}:8000", "id": iid}}  # noqa: E731
    for change in (
        add("a"),
        {"op": "drain", "id": "a"},
        add("b"),
        {"op": "remove", "id": "a"},  # a is gone: its add and drain need not run on a replay
        add("a"),  # back, under the same id: this add stays
        {"op": "remove", "id": "zzz"},
        {
            "op": "add",
            "id": "c:8000",
            "config": {"url": "http://c:8000"},
        },  # the id admin.py derives from the URL
        {"op": "remove", "id": "c:8000"},
    ):
        j.append(change)
    entries = AdminJournal(str(tmp_path), worker=1, workers=2).new_entries()  # a worker that starts now
    assert [seq for seq, _ in entries] == list(range(1, 9))
    assert undone_later(entries) == {1, 2, 7}
    assert undone_later(entries[4:]) == {7}  # a later batch alone
