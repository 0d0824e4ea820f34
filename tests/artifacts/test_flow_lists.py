"""How artifacts write lists: integers on one line, anything else a line per item, alike from
both YAML emitters (`canonical._dump` takes libyaml's where every string is printable ASCII)."""

from __future__ import annotations

import yaml

from spindle_cli.artifacts import canonical


def test_a_list_of_integers_is_one_line_and_reads_back_the_same():
    data = {"ranks": [4, 5, 6, 7], "ids": ["w0.0", "w0.1"], "empty": [], "nested": [[0, 1]],
            "long": list(range(64))}
    text = canonical._dump(data)
    lines = text.splitlines()
    assert "ranks: [4, 5, 6, 7]" in lines
    assert lines[lines.index("ids:") + 1:lines.index("ids:") + 3] == ["- w0.0", "- w0.1"]
    assert "empty: []" in lines and "- [0, 1]" in lines
    # a long list wraps once past the width (100 columns), an item at a time
    assert lines[-1].startswith("  ") and max(map(len, lines)) < 110
    assert yaml.safe_load(text) == data
    for dumper in (canonical._Dumper, canonical._FastDumper):
        assert yaml.dump(data, Dumper=dumper, sort_keys=False, default_flow_style=False,
                         width=100) == text


def test_an_empty_value_takes_the_fast_emitter_and_an_empty_key_does_not():
    # every baseline plan has `candidate: ''`, and the whole plan went to the Python emitter
    # (a 100-task plan of 4096 devices: 31.3 s against 15.5 s, the same bytes)
    for data, fast in (({"candidate": "", "ranks": [0, 1]}, True),
                       ({"a": [{"b": ""}, ""]}, True),
                       ({"": 1}, False),
                       ({"a": "tab\there"}, False)):
        assert canonical._printable_ascii(data) is fast
        assert canonical._dump(data) == yaml.dump(data, Dumper=canonical._Dumper, sort_keys=False,
                                                  default_flow_style=False, width=100)
