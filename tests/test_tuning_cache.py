"""The matmul tuners' disk cache (kernels/tuning_cache.py): a choice made once is read back by a
later process without tuning, and only for the same GPU, versions, kernel sources and candidate
sets; a broken file or folder costs a tuning, never a wrong tile or a failed start."""
import json
import logging

import pytest
import torch

from kernel_env import DEV  # noqa: F401  (before any kernel module)
from pagedbackend.kernels import tuning_cache  # noqa: E402

KEY = (None, 1, 6144, 4096, torch.bfloat16, 4, 128, 0)
TILE = (64, 256, 4, 3, False, 3, 2)


@pytest.fixture()
def cache(tmp_path, monkeypatch):
    """The cache in a fresh folder, as a new process sees it (nothing read yet)."""
    monkeypatch.setenv(tuning_cache.ENV, str(tmp_path))
    monkeypatch.setattr(tuning_cache, "_LOADED", {})
    return tmp_path


def new_process(monkeypatch):
    monkeypatch.setattr(tuning_cache, "_LOADED", {})


def must_not_tune():
    raise AssertionError("tuned although the cache holds the choice")


def test_a_choice_is_read_back_by_the_next_process(cache, monkeypatch):
    calls = []

    def tune():
        calls.append(1)
        return TILE
    assert tuning_cache.remembered("w4", KEY, ("sets",), tune) == TILE
    assert tuning_cache.remembered("w4", KEY, ("sets",), must_not_tune) == TILE
    assert calls == [1]
    files = list(cache.iterdir())
    assert [f.name for f in files] == [tuning_cache.file_name(None)]
    assert files[0].name.startswith("cpu-") and files[0].name.endswith(".json")
    new_process(monkeypatch)
    assert tuning_cache.remembered("w4", KEY, ("sets",), must_not_tune) == TILE
    # None (the library's kernel) and nested values come back as they went in
    other = (*KEY[:2], 4096, *KEY[3:])
    ranked = (TILE, [TILE, (64, 128, 4, 3, False, 3, 4)])
    assert tuning_cache.remembered("w4", other, ("sets",), lambda: ranked) == ranked
    assert tuning_cache.remembered("skinny", KEY, ("sets",), lambda: None) is None
    new_process(monkeypatch)
    assert tuning_cache.remembered("w4", other, ("sets",), must_not_tune) == ranked
    assert tuning_cache.remembered("skinny", KEY, ("sets",), must_not_tune) is None


def test_other_candidates_tables_or_keys_tune_again(cache):
    tuning_cache.remembered("w4", KEY, ("sets",), lambda: TILE)
    assert tuning_cache.remembered("w4", KEY, ("other sets",), lambda: None) is None
    assert tuning_cache.remembered("skinny", KEY, ("sets",), lambda: (16, 512, 4, 3)) \
        == (16, 512, 4, 3)
    assert tuning_cache.remembered("w4", (*KEY[:-1], 3), ("sets",), lambda: None) is None
    assert tuning_cache.remembered("w4", KEY, ("sets",), must_not_tune) == TILE


@pytest.mark.parametrize("value", ["off", "0", ""])
def test_off_keeps_nothing_on_disk(value, tmp_path, monkeypatch):
    monkeypatch.setenv(tuning_cache.ENV, value)
    monkeypatch.chdir(tmp_path)
    calls = []
    for _ in range(2):
        tuning_cache.remembered("w4", KEY, (), lambda: calls.append(1) or TILE)
    assert calls == [1, 1] and tuning_cache.directory() is None
    assert list(tmp_path.iterdir()) == []


def test_default_folder_is_the_user_cache(monkeypatch, tmp_path):
    monkeypatch.delenv(tuning_cache.ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert tuning_cache.directory() == tmp_path / "pagedbackend" / "tuning"


def test_a_broken_file_is_ignored_and_rewritten(cache, monkeypatch, caplog):
    path = cache / tuning_cache.file_name(None)
    path.write_text("{not json")
    with caplog.at_level(logging.WARNING, logger="pagedbackend"):
        assert tuning_cache.remembered("w4", KEY, (), lambda: TILE) == TILE
    assert "unreadable" in caplog.text
    assert len(json.loads(path.read_text())["entries"]) == 1
    # an entry that is not a literal: tuned again, with a warning
    data = json.loads(path.read_text())
    data["entries"] = {k: "os.system('x')" for k in data["entries"]}
    path.write_text(json.dumps(data))
    new_process(monkeypatch)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="pagedbackend"):
        assert tuning_cache.remembered("w4", KEY, (), lambda: None) is None
    assert "unreadable, tuned again" in caplog.text


def test_an_unwritable_folder_costs_only_the_tuning(tmp_path, monkeypatch, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv(tuning_cache.ENV, str(blocker / "tuning"))     # under a plain file
    monkeypatch.setattr(tuning_cache, "_LOADED", {})
    monkeypatch.setattr(tuning_cache, "_UNWRITABLE", set())
    with caplog.at_level(logging.WARNING, logger="pagedbackend"):
        assert tuning_cache.remembered("w4", KEY, (), lambda: TILE) == TILE
        assert tuning_cache.remembered("w4", KEY[:1] + (2,) + KEY[2:], (), lambda: None) is None
    assert caplog.text.count("not written") == 1      # once, not once a shape


def test_a_failed_write_leaves_no_temporary_file(cache, monkeypatch):
    def disk_full(*a, **kw):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(tuning_cache.json, "dump", disk_full)
    monkeypatch.setattr(tuning_cache, "_UNWRITABLE", set())
    assert tuning_cache.remembered("w4", KEY, (), lambda: TILE) == TILE
    assert list(cache.iterdir()) == []


def test_processes_tuning_at_once_keep_both_entries(cache, monkeypatch):
    """Two processes that read the file before either wrote it (tensor-parallel ranks)."""
    tuning_cache._entries(cache / tuning_cache.file_name(None))
    theirs = dict(tuning_cache._LOADED)
    tuning_cache.remembered("w4", KEY, (), lambda: TILE)
    monkeypatch.setattr(tuning_cache, "_LOADED", {k: {} for k in theirs})     # the other one
    other = (*KEY[:2], 4096, *KEY[3:])
    tuning_cache.remembered("w4", other, (), lambda: None)
    new_process(monkeypatch)
    assert tuning_cache.remembered("w4", KEY, (), must_not_tune) == TILE
    assert tuning_cache.remembered("w4", other, (), must_not_tune) is None


def test_the_file_changes_with_the_kernel_sources(tmp_path, monkeypatch):
    for src in tuning_cache._KERNELS.glob("*.py"):
        (tmp_path / src.name).write_bytes(src.read_bytes())
    monkeypatch.setattr(tuning_cache, "_KERNELS", tmp_path)
    monkeypatch.setattr(tuning_cache, "_FINGERPRINT", {})
    before = tuning_cache.file_name(None)
    with open(tmp_path / "gemv_w4.py", "a") as f:
        f.write("\n# a changed tile\n")
    monkeypatch.setattr(tuning_cache, "_FINGERPRINT", {})
    assert tuning_cache.file_name(None) != before


def test_the_4_bit_tuner_reads_its_choice_and_ranking_from_the_cache(cache, monkeypatch):
    """gemv_w4_tuning._config: a shape tuned by an earlier process (its plain choice, the
    ranking the prologue tries come from, and a prologue's choice) is not tuned again."""
    from pagedbackend.kernels import gemv_w4_tuning as tuning
    from pagedbackend.layers.quant_grouped import PackedWeight
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(tuning, "_CHOICE", {})
    monkeypatch.setattr(tuning, "_RANKED", {})
    n, k = 256, 512
    pw = PackedWeight(4, 128, torch.zeros(n, k // 2, dtype=torch.uint8),
                      torch.ones(k // 128, n, dtype=torch.float16),
                      torch.zeros(k // 128, n, dtype=torch.uint8), None, None)
    x = torch.zeros(1, k, dtype=torch.float16)
    ranked = [TILE, (64, 256, 4, 3, False, 2, 2)]

    def first_tune(x_, pw_, bias, prologue):
        if prologue == tuning.PLAIN:
            tuning._RANKED[tuning._key(x_, pw_, prologue)] = ranked
            return TILE
        return None
    monkeypatch.setattr(tuning, "_tune", first_tune)
    assert tuning._config(x, pw, None, tuning.PLAIN) == TILE
    assert tuning._config(x, pw, None, tuning.ADD_NORM) is None
    monkeypatch.setattr(tuning, "_CHOICE", {})
    monkeypatch.setattr(tuning, "_RANKED", {})
    new_process(monkeypatch)
    monkeypatch.setattr(tuning, "_tune", lambda *a: must_not_tune())
    assert tuning._config(x, pw, None, tuning.ADD_NORM) is None
    assert tuning._config(x, pw, None, tuning.PLAIN) == TILE
    assert tuning._RANKED[tuning._key(x, pw, tuning.PLAIN)] == ranked


def test_the_skinny_tuner_reads_its_choice_from_the_cache(cache, monkeypatch):
    from pagedbackend.kernels import gemv_tuning
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(gemv_tuning, "_CHOICE", {})
    monkeypatch.setattr(gemv_tuning, "ENABLED", True)
    w = torch.zeros(256, 512, dtype=torch.bfloat16)
    x = torch.zeros(1, 512, dtype=torch.bfloat16)
    monkeypatch.setattr(gemv_tuning, "_tune", lambda *a: (16, 512, 4, 3))
    assert gemv_tuning._choice(x, w, None) == (16, 512, 4, 3)
    monkeypatch.setattr(gemv_tuning, "_CHOICE", {})
    new_process(monkeypatch)
    monkeypatch.setattr(gemv_tuning, "_tune", lambda *a: must_not_tune())
    assert gemv_tuning._choice(x, w, None) == (16, 512, 4, 3)
    # an A/B that swaps a candidate list (perf/common.py's fp8oldtiles) tunes again
    monkeypatch.setattr(gemv_tuning, "_CHOICE", {})
    monkeypatch.setattr(gemv_tuning, "FP8_WIDEN_CANDIDATES", ())
    monkeypatch.setattr(gemv_tuning, "_tune", lambda *a: None)
    assert gemv_tuning._choice(x, w, None) is None
