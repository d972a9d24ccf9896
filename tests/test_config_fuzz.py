"""Property tests: whatever keys, types and values a config file or the command line holds, the
result is a valid config or a one-line error (exit 2), never a traceback."""
import dataclasses

import pytest
import yaml
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from fedcp_dist.config import Config, DataConfig, load_config
from fedcp_dist.errors import UserError
from fedcp_dist.run import main

FIELDS = [f.name for f in dataclasses.fields(Config)] + [f"data.{f.name}" for f in dataclasses.fields(DataConfig)]
scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-10**6, 10**6), st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
)
values = st.one_of(scalars, st.lists(scalars, max_size=3), st.dictionaries(st.text(max_size=5), scalars, max_size=2))
keys = st.one_of(st.sampled_from(FIELDS), st.text(max_size=10))


def _nest(flat: dict) -> dict:
    out: dict = {}
    for k, v in flat.items():
        if k.startswith("data."):
            node = out.setdefault("data", {})
            if isinstance(node, dict):
                node[k[5:]] = v
        else:
            out[k] = v
    return out


@pytest.fixture(scope="module")
def shard_path(tmp_path_factory):
    p = tmp_path_factory.mktemp("fuzz") / "x.h5"
    p.write_bytes(b"")
    return str(p)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.dictionaries(keys, values, max_size=5))
def test_config_file_is_valid_or_one_line_error(tmp_path_factory, shard_path, flat):
    doc = _nest(flat)
    if isinstance(doc.get("data"), dict):
        doc["data"].setdefault("path", shard_path)
    path = tmp_path_factory.mktemp("cfg") / "c.yaml"
    path.write_text(yaml.safe_dump(doc))
    try:
        cfg = load_config(str(path))
    except UserError as exc:
        assert "\n" not in str(exc) and str(exc)
        return
    assert isinstance(cfg, Config)
    assert cfg.rounds > 0 and cfg.batch_size > 0 and 0 < cfg.participation <= 1 and cfg.lam >= 0


override_text = st.one_of(
    st.builds(lambda k, v: f"{k}={v}", st.sampled_from(FIELDS), st.text(max_size=10)),
    st.builds(lambda k, v: f"{k}={yaml.safe_dump(v, default_flow_style=True).strip()}", st.sampled_from(FIELDS), values),
    st.text(max_size=15),
    st.sampled_from(["--config", "--print-config", "--nope", "-x", "--config=/nonexistent.yaml"]),
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(override_text, max_size=4))
@example(argv=["--c", "method=\x00"])  # found by this test: a config path with a NUL byte made open() raise ValueError
@example(argv=["out_dir=runs/a\x00b"])  # a NUL in a value: refused, not left for mkdir to raise on
def test_command_line_is_valid_or_one_line_error(capsys, shard_path, argv):
    try:
        main(["--print-config", f"data.path={shard_path}", *argv])
        code = 0
    except SystemExit as exc:
        code = exc.code
    out, err = capsys.readouterr()
    assert code in (0, 2), (argv, code, err)
    if code == 2:
        assert err.count("\n") == 1 and err.startswith("error: "), (argv, err)
    else:  # printed, whatever data.path is: a path not set (or not made yet) is a note on stderr
        path = yaml.safe_load(out)["data"]["path"]
        assert isinstance(path, str)
        if not path:
            assert err == "note: data.path is not set; a run needs the HDF5 partition written by fedcp-partition\n", err


def test_a_nul_character_in_a_value_is_refused(tmp_path, shard_path):
    """YAML's "\\0" escape gives a NUL that no file name can hold: named at load, not raised by mkdir later."""
    path = tmp_path / "c.yaml"
    path.write_text(f'out_dir: "runs/a\\0b"\ndata: {{path: {shard_path}}}\n')
    with pytest.raises(UserError, match=r"config key 'out_dir': holds a NUL character: 'runs/a\\x00b'"):
        load_config(str(path))
