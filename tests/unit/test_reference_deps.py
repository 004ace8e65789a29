"""A missing reference dependency (transformers, matplotlib) skips a developer's run but fails CI,
where a parity test that skipped would pass a build nobody checked."""

from __future__ import annotations

import pytest

from tests.hf_reference import require_reference

MISSING = "deepserve_no_such_reference_module"


def test_a_present_reference_is_returned() -> None:
    assert require_reference("json").dumps([1]) == "[1]"


@pytest.mark.parametrize("ci", ["true", "1", "TRUE"])
def test_a_missing_reference_fails_in_ci(monkeypatch: pytest.MonkeyPatch, ci: str) -> None:
    monkeypatch.setenv("CI", ci)
    with pytest.raises(pytest.fail.Exception, match=f"CI must run.*{MISSING}.*pip install"):
        require_reference(MISSING)


@pytest.mark.parametrize("ci", [None, "", "false", "0"])
def test_a_missing_reference_skips_elsewhere_naming_it(
    monkeypatch: pytest.MonkeyPatch, ci: str | None
) -> None:
    if ci is None:
        monkeypatch.delenv("CI", raising=False)
    else:
        monkeypatch.setenv("CI", ci)
    with pytest.raises(pytest.skip.Exception, match=f"{MISSING} is not installed"):
        require_reference(MISSING)
