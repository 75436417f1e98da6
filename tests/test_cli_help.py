"""--help of the entry points built on the typed configs."""


def test_the_entry_points_help_is_printed(capsys):
    """--help of the main job and of the go/no-go: every field's help, a '%' in one of them included."""
    import pytest

    from adversary.guided import main as guided_main
    from adversary.train import parse_args

    for call in (lambda: parse_args(["--help"]), lambda: guided_main(["--help"])):
        with pytest.raises(SystemExit) as e:
            call()
        assert e.value.code == 0
    out = capsys.readouterr().out
    assert "--meter_seeds" in out and "--share_pool" in out and "15-20% more" in out
