"""Ranks agree on what shapes their kernels (CPU only): every Config field is agreed or
exempt with its reason, and a difference raises on every rank naming the setting and
the ranks."""

from __future__ import annotations

import dataclasses

import pytest
from thread_ranks import run_ranks

from ubnext._api import agreement as _agreement
from ubnext._environment.config import Config
from ubnext._protocol.errors import UbnextError


def test_every_config_field_is_agreed_or_exempt_with_its_reason():
    """A new field is agreed unless it says why ranks may differ, so none is forgotten."""
    agreed = _agreement.agreed_fields(Config())
    for f in dataclasses.fields(Config):
        local = f.metadata["local"]
        if local is None:
            assert f.metadata["env"] in agreed, f.name
        else:
            assert isinstance(local, str) and len(local) > 10, f"{f.name}: exempt without a reason"
            assert f.metadata["env"] not in agreed
    assert {"UBNEXT_POOL_MB", "UBNEXT_STAGING_MB", "UBNEXT_MAX_BLOCKS", "UBNEXT_LAMPORT_MAX_KB",
            "UBNEXT_LAMPORT_TWOSHOT_MAX_KB", "UBNEXT_ALGO", "UBNEXT_NVLS", "UBNEXT_DEBUG",
            "UBNEXT_TABLE_MODE"} <= set(agreed)
    facts = _agreement.facts(Config())
    assert facts["ubnext version"] and len(facts["kernel sources"]) == 16


def test_agreeing_ranks_pass():
    assert run_ranks(3, lambda boot: _agreement.check(Config(staging_mb=64), boot)) == [None] * 3


@pytest.mark.parametrize("field, values, words", [
    ("staging_mb", (128, 64, 128), "UBNEXT_STAGING_MB: 128 on ranks 0, 2; 64 on rank 1"),
    ("max_blocks", (0, 0, 32), "UBNEXT_MAX_BLOCKS: 0 on ranks 0, 1; 32 on rank 2"),
    ("algorithm", ("auto", "twoshot", "auto"), "UBNEXT_ALGO: 'auto' on ranks 0, 2; 'twoshot' on rank 1"),
    # the selector tables' entries are chosen for it: ranks that differ would choose other rows
    ("table_mode", ("graph", "graph", "dependent"),
     "UBNEXT_TABLE_MODE: 'graph' on ranks 0, 1; 'dependent' on rank 2"),
])
def test_a_difference_raises_on_every_rank_naming_setting_and_ranks(field, values, words):
    results = run_ranks(3, lambda boot: _agreement.check(Config(**{field: values[boot.rank]}), boot))
    assert all(isinstance(r, UbnextError) for r in results), results
    assert len({str(r) for r in results}) == 1
    assert str(results[0]).startswith("Communicator: the ranks disagree on " + words)


def test_other_kernel_sources_or_versions_differ_too(monkeypatch):
    digests = iter(["aaaa", "bbbb"])
    monkeypatch.setattr(_agreement, "kernel_digest", lambda: next(digests))
    results = run_ranks(2, lambda boot: _agreement.check(Config(), boot))
    assert all("kernel sources: 'aaaa' on rank" in str(r) for r in results), results


def test_an_exempt_field_may_differ():
    timeouts = (600.0, 30.0)
    results = run_ranks(2, lambda boot: _agreement.check(Config(timeout_s=timeouts[boot.rank],
                                                                log_level=("INFO", "ERROR")[boot.rank]), boot))
    assert results == [None, None]


def test_the_communicator_checks_before_any_setup(monkeypatch):
    """Communicator() compares the ranks before its pool or devices (the check raises on
    a CPU machine before anything needs a GPU)."""
    import ubnext
    from ubnext._environment import preflight as _preflight

    monkeypatch.setattr(_preflight, "check", lambda op, config: None)

    def rank(boot):
        return ubnext.Communicator(bootstrap=boot, staging_mb=(64, 32)[boot.rank])

    results = run_ranks(2, rank)
    assert all(isinstance(r, UbnextError) and "UBNEXT_STAGING_MB: 64 on rank 0; 32 on rank 1" in str(r)
               for r in results), results
