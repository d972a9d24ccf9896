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


def _validate(values: dict):
    from fedcp_dist.config import load_config, unflatten
    return load_config(values=unflatten(dict(values)), validate=False).validate(data_file=False)


def test_every_stated_rule_is_the_one_validation_enforces():
    import pytest
    from fedcp_dist.errors import UserError
    keys = set(config_reference.keys())
    assert config_reference.RULES, "the page states no rule"
    for rule in config_reference.RULES:
        assert rule.key in keys, rule.key
        with pytest.raises(UserError) as err:  # the config that breaks the rule is refused ...
            _validate(rule.refused)
        assert rule.key in str(err.value), (rule.key, str(err.value))
        _validate(rule.accepted)  # ... and the one made to keep it starts
    # every rule and reference default is on the page, on its key's row
    page = config_reference.render().splitlines()
    for key, text in [(r.key, "**Rule:**") for r in config_reference.RULES] + \
                     [(k, "**Reference library:**") for k in config_reference.REFERENCE]:
        row = [line for line in page if line.startswith(f"| `{key}` |")]
        assert len(row) == 1 and text in row[0], key


def test_keys_link_the_methods_they_act_on():
    import re
    page = config_reference.render()
    assert "acts on [FedCP](methods.md#" in page and "acts on [FedRep](" in page
    # every anchor a row links exists on the page it names (mkdocs --strict checks it too)
    links = set(re.findall(r"\(([a-z-]+\.md)#([a-z0-9_-]+)\)", page))
    assert {p for p, _ in links} >= {"methods.md", "fedcp-extensions.md", "uploads.md"}
    for name in {p for p, _ in links}:
        text = (REPO / "docs" / name).read_text(encoding="utf-8")
        headings = {re.sub(r"[^\w\s-]", "", h.strip().lower()).replace(" ", "-")
                    for h in re.findall(r"^#+ (.+)$", text, flags=re.M)}
        anchors = {a for p, a in links if p == name}
        assert anchors <= headings, (name, anchors - headings)
