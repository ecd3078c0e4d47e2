"""Every reproduction at --scale tiny: files written, qualitative claims hold (fixed seeds)."""

from __future__ import annotations

from pathlib import Path

import pytest

from pansketch.host_tools import cli
from pansketch.host_tools.lab.repro import dp_linear, intermittent, lazy, panprivate


@pytest.mark.slow
def test_dp_linear_tiny(tmp_path: Path):
    r = dp_linear.run("tiny", tmp_path, seed=1)
    for f in ("dp_linear.md", "dp_linear.json", "fig1_are_paper.png", "fig1_f1_notebook.png", "fig2_rank_error.png"):
        assert (tmp_path / f).stat().st_size > 0
    s = r["summary"]
    # Private CountSketch ARE within a small factor of non-private at rho = 10 (Fig. 1, §5.3)
    assert s["pcs10_over_cs_max_ratio_paper"] < 1.5
    # at the paper's shapes Private Count-Min (paper E) gets *better* with space ...
    for rho, ares in s["pcms_degrades_with_space_paperE"].items():
        assert ares[-1] < ares[0]
    # ... while the notebook's shapes and offset reproduce the published rising curve
    nb = s["notebook_pcms01_are"]
    assert nb[-1] > nb[0]
    # DCS rank errors an order of magnitude below gamma*N (§5.4)
    n = dp_linear.CONFIG["tiny"]["n"]
    for sname in ("paper", "notebook"):
        assert max(s["dcs_%s_max_err" % sname].values()) < 0.01 * n


@pytest.mark.slow
def test_intermittent_tiny(tmp_path: Path):
    r = intermittent.run("tiny", tmp_path, seed=1)
    assert (tmp_path / "fig3_nq.png").exists() and (tmp_path / "fig4_u.png").exists()
    s = r["summary"]
    assert s["error_decreasing_in_eps"]  # §VI: the error increases with decreasing eps
    assert s["error_by_u"][5000] > s["error_by_u"][50]  # Fig. 4: larger pool, larger error


@pytest.mark.slow
def test_lazy_tiny(tmp_path: Path):
    r = lazy.run("tiny", tmp_path, seed=1)
    assert (tmp_path / "fig4.png").exists()
    s = r["summary"]
    # the speed-up is asserted as work, not wall-clock time (machine load moves the latter): the
    # binary-mechanism updates per arrival counted in the timed runs are 3 for Lazy and 3w for
    # Punctual, so the ratio is Punctual's width, at the same width and at the same memory
    for w in lazy.CONFIG["tiny"]["same_w"]:
        assert r["same_width"][w]["ops_LazyCMS"] == 3
        assert r["same_width"][w]["ops_PunctualCMS"] == 3 * w
        assert s["lazy_over_punctual_same_width_ops"][w] == w
    for mem, w in s["punctual_width_by_memory"].items():
        assert s["lazy_over_punctual_ops_by_memory"][mem] == w
        assert r["fig4a"]["LazyCS"][mem]["bm_updates_per_arrival"] == 3
        assert r["fig4a"]["CMS"][mem]["bm_updates_per_arrival"] == 0
    assert all(s["fig4f_are_decreasing_in_eps"].values())  # Fig. 4(f): error decreasing in eps at low collision
    assert r["vectorised"]["identical_state"]


@pytest.mark.slow
def test_panprivate_tiny(tmp_path: Path):
    r = panprivate.run("tiny", tmp_path, seed=1)
    assert (tmp_path / "distinct.png").exists() and (tmp_path / "hh_count.png").exists()
    s = r["summary"]
    assert s["cropped_within_lemma5_min"] >= 0.9
    assert s["hh_within_thm12_min"] >= 0.9


@pytest.mark.slow
def test_cli_repro(tmp_path: Path, capsys):
    assert cli.main(["repro", "dp-linear", "--scale", "tiny", "--out", str(tmp_path / "o")]) == 0
    assert (tmp_path / "o" / "dp_linear.md").exists()
    with pytest.raises(SystemExit):
        cli.main(["repro", "nope"])


@pytest.mark.slow
def test_repro_shows_progress_within_a_paper(tmp_path: Path, capsys):
    """Each paper says which experiment it is in (stderr), so a long run is never silent."""
    assert cli.main(["repro", "panprivate", "--scale", "tiny", "--out", str(tmp_path / "p")]) == 0
    err = capsys.readouterr().err
    steps = [ln for ln in err.splitlines() if ln.rstrip().endswith("...")]
    assert len(steps) >= 4 and any("heavy hitters" in s for s in steps), err
