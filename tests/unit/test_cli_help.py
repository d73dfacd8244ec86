"""Every command explains itself (issue 17): each option of each subcommand has a help text, and the help says
its default wherever it has one."""

import argparse

import pytest

from eagle3 import cli


def _subparsers(parser):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield name, sub
                for inner, subsub in _subparsers(sub):
                    yield f"{name} {inner}", subsub


SUBS = dict(_subparsers(cli.build_parser()))


@pytest.mark.parametrize("name", sorted(SUBS))
def test_each_option_has_help_and_its_default(name):
    sub = SUBS[name]
    fmt = sub._get_formatter()
    assert sub.format_help()  # renders (a stray % in a help text would raise here)
    for action in sub._actions:
        if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
            continue
        flag = action.option_strings[-1] if action.option_strings else action.dest
        assert action.help, f"eagle3 {name} {flag}: no help text"
        if action.option_strings and action.default not in (None, False):
            assert "default" in fmt._get_help_string(action), f"eagle3 {name} {flag}: help does not state the default"


def test_all_subcommands_are_covered():
    assert {"doctor", "extract", "train", "demo", "verify", "eval", "make-target", "bench", "bench report"} <= set(SUBS)
