"""How a worker hands an error a restart would meet again to the launcher
(titan/runtime/final_error.py; the whole path through run_train.sh is in
tests/integration/test_fault_tolerance.py)."""

from titan.runtime import final_error


def test_the_first_rank_to_record_wins_in_one_line(monkeypatch, tmp_path):
    path = tmp_path / "final_error.json"
    monkeypatch.delenv(final_error.ENV, raising=False)
    final_error.record("data error", "not asked for", 2)  # no launcher: nothing written
    assert list(tmp_path.iterdir()) == []

    monkeypatch.setenv(final_error.ENV, str(path))
    monkeypatch.setenv("RANK", "3")
    final_error.record("data error", ValueError("x.jsonl is bad\n  at record 7"), 2)
    monkeypatch.setenv("RANK", "0")
    final_error.record("checkpoint error", "a consequence of rank 3's", 2)
    entry = final_error.read(path)
    assert entry == {
        "kind": "data error",
        "message": "x.jsonl is bad at record 7",
        "exit_code": 2,
        "rank": 3,
    }
    assert list(tmp_path.iterdir()) == [path]  # no temporary file left behind
    assert (
        final_error.one_line(entry, max_restarts=0)
        == "titan: data error on rank 3: x.jsonl is bad at record 7"
    )
    assert final_error.one_line(entry, max_restarts=2).endswith(
        "(not restarted: a restart would fail the same way)"
    )
    assert final_error.read(tmp_path / "absent.json") is None
