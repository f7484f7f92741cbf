"""``megamoe-rt sweep --spec``: a spec file by path, or a spec the package ships by name
(megamoe_rt/graph/spec.py, ``resolve_spec``); graphs/ in the source tree, megamoe_rt/graphs in
the wheel (pyproject.toml's force-include)."""

from __future__ import annotations

from pathlib import Path

import pytest

import megamoe_rt.cli.commands as commands
import megamoe_rt.cli.main as cli
from megamoe_rt.graph import SpecError, spec
from megamoe_rt.graph.spec import resolve_spec, shipped_spec_names, shipped_specs_dir

GRAPHS = Path(__file__).resolve().parents[2] / "graphs"


def test_the_shipped_specs_are_the_source_trees_graphs():
    assert shipped_specs_dir() == GRAPHS
    assert shipped_spec_names() == sorted(p.stem for p in GRAPHS.glob("*.toml"))
    assert "membound_vs_gemm" in shipped_spec_names()


@pytest.mark.parametrize("name", ["membound_vs_gemm", "membound_vs_gemm.toml"])
def test_a_shipped_spec_is_found_by_name(name, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # from anywhere, not only the repository root
    assert resolve_spec(name) == GRAPHS / "membound_vs_gemm.toml"


def test_a_path_is_taken_as_it_is_even_where_a_shipped_name_matches(tmp_path, monkeypatch):
    own = tmp_path / "membound_vs_gemm.toml"
    own.write_text('name = "mine"\n')
    monkeypatch.chdir(tmp_path)
    assert resolve_spec("membound_vs_gemm.toml") == Path("membound_vs_gemm.toml")
    assert resolve_spec(own) == own
    assert resolve_spec(str(GRAPHS / "split_moe_96_32.toml")) == GRAPHS / "split_moe_96_32.toml"


def test_an_unknown_name_lists_the_shipped_ones():
    with pytest.raises(SpecError) as exc:
        resolve_spec("nope")
    message = str(exc.value)
    assert message.startswith("nope: no such file or shipped spec")
    assert all(name in message for name in shipped_spec_names()) and "\n" not in message


def test_a_missing_file_is_not_looked_up_by_name(tmp_path):
    with pytest.raises(SpecError, match="no such file \\(shipped specs: .*membound_vs_gemm"):
        resolve_spec(str(tmp_path / "membound_vs_gemm.toml"))
    with pytest.raises(SpecError, match="a directory"):
        resolve_spec(str(tmp_path))


def test_the_installed_packages_specs_come_first(tmp_path, monkeypatch):
    pkg = tmp_path / "site" / "megamoe_rt"
    (pkg / "graphs").mkdir(parents=True)
    (pkg / "graphs" / "only_here.toml").write_text('name = "x"\n')
    (tmp_path / "site" / "graphs").mkdir()  # another distribution's graphs/ beside it: not ours
    monkeypatch.setattr(spec, "_PKG_DIR", pkg)
    assert shipped_specs_dir() == pkg / "graphs"
    assert shipped_spec_names() == ["only_here"]
    assert resolve_spec("only_here") == pkg / "graphs" / "only_here.toml"
    (pkg / "graphs" / "only_here.toml").unlink()
    (pkg / "graphs").rmdir()
    assert shipped_specs_dir() is None  # no pyproject.toml beside site/graphs: not a checkout
    with pytest.raises(SpecError, match="shipped specs: none found"):
        resolve_spec("only_here")


def test_sweep_with_an_unknown_spec_says_so_in_one_line_before_the_gpu(capsys, monkeypatch):
    def probed(*args, **kwargs):
        raise AssertionError("the GPU was probed")

    monkeypatch.setattr(commands, "hopper_or_none", probed)
    assert cli.main(["sweep", "--spec", "nope", "--vary", "gemm=16..32:16"]) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("megamoe-rt sweep: --spec nope: no such file or shipped spec")
    assert "membound_vs_gemm" in lines[0]
