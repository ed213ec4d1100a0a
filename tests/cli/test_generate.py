"""`ebpo generate --help` documents the multi-turn options as argparse entries, and bad JSON in them exits 2
with the flag's name."""
import re

import pytest

from ebpo.cli import main


def run(argv, capsys):
    try:
        code = main(argv)
    except SystemExit as e:
        code = e.code or 0
    out = capsys.readouterr()
    return code, out.out, out.err


def test_generate_help_has_an_entry_for_each_multiturn_option(capsys):
    code, out, _ = run(["generate", "--help"], capsys)
    assert code == 0 and "usage: ebpo generate" in out
    assert "multi-turn (agent) rollouts:" in out
    for flag, metavar, words in [("--env", "REF", "built-in"), ("--env-kwargs", "JSON", "keyword arguments"),
                                 ("--multiturn", "JSON", "MultiTurnConfig")]:
        # an entry: the flag and its metavar at the start of a line, its help text right after it
        entry = re.search(rf"^  {re.escape(flag)} {metavar}\s+(.+(?:\n {{10,}}.+)*)", out, re.M)
        assert entry is not None, flag
        assert words in entry.group(1)
    # the usage line lists them too (not only a note)
    assert "[--env REF]" in out and "[--env-kwargs JSON]" in out and "[--multiturn JSON]" in out


@pytest.mark.parametrize("flag,value,needle", [("--env-kwargs", "{bad", "not valid JSON"),
                                               ("--multiturn", "[1]", "must be a JSON object")])
def test_bad_json_names_the_flag_and_exits_two(capsys, flag, value, needle):
    code, _, err = run(["generate", "--env", "calculator", flag, value, "--prompt", "x"], capsys)
    assert code == 2 and flag in err and needle in err
