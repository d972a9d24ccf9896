"""The configuration reference page is generated from the options' declarations: it is complete
(every key `--print-config` prints) and not stale."""
import dataclasses

import yaml

from conftest import REPO
from fedcp_dist.cli import config_reference
from fedcp_dist.config import Config, dump_config, flatten
from fedcp_dist.options import Option


def test_the_page_is_what_the_declarations_render():
    page = (REPO / "docs" / "configuration.md").read_text(encoding="utf-8")
    assert page == config_reference.render(), "docs/configuration.md is stale: run python -m fedcp_dist.cli.config_reference"


def test_every_printed_key_is_in_the_page_once_with_its_default():
    printed = list(flatten(yaml.safe_load(dump_config(Config()))))
    assert printed == config_reference.keys()  # the same keys, in --print-config's order
    page = config_reference.render()
    for key in printed:
        assert sum(line.startswith(f"| `{key}` |") for line in page.splitlines()) == 1, key
    # every Config field carries the Option it was made from, whose help the page shows
    for f in dataclasses.fields(Config):
        if f.name != "data":
            opt = f.metadata["option"]
            assert isinstance(opt, Option) and " ".join(opt.help.split())[:40].replace("|", "\\|") in page


def test_check_mode_reports_a_stale_page(tmp_path, capsys):
    out = tmp_path / "configuration.md"
    assert config_reference.main(["--out", str(out)]) == 0
    assert config_reference.main(["--check", "--out", str(out)]) == 0
    out.write_text(out.read_text() + "hand edit\n")
    assert config_reference.main(["--check", "--out", str(out)]) == 1
    assert "stale" in capsys.readouterr().err
