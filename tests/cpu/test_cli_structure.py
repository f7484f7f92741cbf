"""How the command line is built: one module per subcommand, mode names only in the registry.

``megamoe_rt.cli.main`` builds the parser from the modules of ``megamoe_rt.cli.commands`` and
dispatches to them; each module holds one subcommand's options (``add_parser``) and what it
runs (``run``). No module of the command line spells an execution mode's name: its choices,
defaults and checks come from ``megamoe_rt.modes.registry``, so a new mode needs no CLI edit.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

import megamoe_rt
import megamoe_rt.cli.commands as commands
import megamoe_rt.cli.main as cli
from megamoe_rt.modes.registry import mode_names

PACKAGE_DIR = Path(megamoe_rt.__file__).parent
COMMANDS_PACKAGE = commands.__name__


def _subcommands() -> dict[str, argparse.ArgumentParser]:
    parser = cli.build_parser()
    (action,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(action.choices)


def _module_of(command: str) -> str:
    return f"{COMMANDS_PACKAGE}.{command.replace('-', '_')}"


def _command_modules() -> set[str]:
    return {f"{COMMANDS_PACKAGE}.{m.name}" for m in pkgutil.iter_modules(commands.__path__)}


# --- one module per subcommand ----------------------------------------------------------------


@pytest.mark.parametrize("command", sorted(_subcommands()))
def test_a_subcommand_runs_the_run_of_its_own_module(command):
    func = _subcommands()[command].get_default("func")
    assert (func.__module__, func.__name__) == (_module_of(command), "run")


def test_every_command_module_is_one_subcommand_and_main_lists_each_once():
    subcommands = _subcommands()
    assert _command_modules() == {_module_of(c) for c in subcommands}
    assert sorted(m.__name__ for m in cli.COMMANDS) == sorted(_command_modules())  # each once
    for name in _command_modules():
        module = importlib.import_module(name)
        assert callable(module.add_parser) and callable(module.run), name


def test_main_only_builds_the_parser_and_dispatches():
    """main.py defines no command: its only functions are build_parser and main (and the
    closure main runs), and its only option is the top-level ``--version``."""
    tree = ast.parse(Path(cli.__file__).read_text())
    top_level = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    assert top_level == {"build_parser", "main"}
    options = [
        n.args[0].value
        for n in ast.walk(tree)
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "add_argument"
    ]
    assert options == ["--version"]


def test_building_the_parser_imports_no_mode():
    """The subcommands' mode choices and defaults come from the registry's names: building the
    parser imports none of the mode classes (nor the kernels behind them)."""
    code = (
        "import sys, megamoe_rt.cli.main as m; m.build_parser(); "
        "print([k for k in sys.modules if k.startswith(('megamoe_rt.modes.', 'megamoe_rt.kernels'))])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "['megamoe_rt.modes.registry']"


# --- mode names only in the registry ----------------------------------------------------------


def _scanned() -> list[Path]:
    """Every module of the command line (megamoe_rt/cli, the commands package included) and
    megamoe_rt/testing.py; megamoe_rt/modes/registry.py is where the names are spelled."""
    return sorted((PACKAGE_DIR / "cli").rglob("*.py")) + [PACKAGE_DIR / "testing.py"]


def mode_literals(source: str) -> list[tuple[int, str]]:
    """(line, name) of every string constant in ``source`` equal to a mode name.

    Every string constant counts: docstrings, help texts, messages, keyword values, dict keys,
    the literal parts of f-strings. Nothing is allowed, because nothing needs to be: prose that
    mentions a mode (a docstring, a help text, an error message) is never a constant equal to a
    bare mode name, so it passes as it is; a constant that is exactly a mode name is a choice,
    a default, a comparison or an argument, which the registry provides."""
    names = set(mode_names())
    return [
        (node.lineno, node.value)
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in names
    ]


def test_the_scan_sees_mode_names_spelled_in_code():
    planted = 'def f(m="fused"):\n    """The unfused mode."""\n    return m == "split" or f"{m}" == "unfused"\n'
    assert sorted(mode_literals(planted)) == [(1, "fused"), (3, "split"), (3, "unfused")]


@pytest.mark.parametrize("path", _scanned(), ids=lambda p: str(p.relative_to(PACKAGE_DIR)))
def test_no_cli_module_spells_a_mode_name(path):
    found = mode_literals(path.read_text())
    assert not found, f"{path.relative_to(PACKAGE_DIR)}: mode names spelled at (line, name) {found}"
